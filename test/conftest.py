"""Shared fixtures: the LeRobot parity fixture and small models."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels can only run in its interpreter, and Triton reads this when it is first
# imported (its own library functions are decorated then): set it before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# ROS tests stay on this machine and off the default domain 0 when run without `make test` (which sets
# both): found in review, a plain `pytest` ran nodes on domain 0 with subnet-wide discovery.
os.environ.setdefault("ROS_DOMAIN_ID", "42")
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
from safetensors.torch import load_file

from rmuscle_ros.models.checkpoint import init_random_
from rmuscle_ros.models.config import GemmaConfig, Pi05Config, VisionConfig, get_preset
from rmuscle_ros.models.pi05 import ModelInputs, Pi05Model

LEROBOT_FIXTURE = Path(__file__).parent / "data" / "lerobot_pi05_reduced"


def lerobot_fixture_config() -> Pi05Config:
    """Our config for the dims LeRobot's reduced π0.5 was built with (config.json of the fixture)."""
    meta = json.loads((LEROBOT_FIXTURE / "config.json").read_text())
    dims, v = meta["dims"], meta["dims"]["vision"]
    return Pi05Config(
        vision=VisionConfig(width=v["width"], depth=v["depth"], mlp_dim=v["mlp_dim"], num_heads=v["heads"]),
        vlm=GemmaConfig(**dims["vlm"]),
        expert=GemmaConfig(**dims["expert"]),
        vocab_size=dims["vocab"],
        action_dim=dims["action_dim"],
        horizon=dims["horizon"],
        num_steps=dims["steps"],
        num_cameras=len(meta["cameras"]),
    )


def lerobot_fixture_io() -> tuple[ModelInputs, torch.Tensor, torch.Tensor]:
    """(inputs, noise, LeRobot's actions) for the fixture's batch of 2."""
    meta = json.loads((LEROBOT_FIXTURE / "config.json").read_text())
    io = load_file(str(LEROBOT_FIXTURE / "io.safetensors"))
    images = torch.stack([io[f"image_{cam}"] for cam in meta["cameras"]], dim=1)
    return ModelInputs(images, io["image_masks"], io["tokens"], io["token_mask"]), io["noise"], io["actions"]


def random_inputs(
    cfg: Pi05Config, batch: int = 1, valid_tokens: int = 12, pad_to: int = 16, seed: int = 0
) -> tuple[ModelInputs, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    c, s = cfg.num_cameras, cfg.vision.image_size
    images = torch.rand(batch, c, 3, s, s, generator=gen) * 2 - 1
    tokens = torch.randint(0, cfg.vocab_size, (batch, pad_to), generator=gen)
    token_mask = (torch.arange(pad_to) < valid_tokens).expand(batch, pad_to).clone()
    noise = torch.randn(batch, cfg.horizon, cfg.action_dim, generator=gen)
    return ModelInputs(images, torch.ones(batch, c, dtype=torch.bool), tokens, token_mask), noise


def tiny_model(cfg: Pi05Config | None = None, seed: int = 0) -> Pi05Model:
    model = Pi05Model(cfg or get_preset("tiny")).eval()
    init_random_(model, seed)
    return model


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="session")
def tiny() -> Pi05Model:
    return tiny_model()


_CORPUS = [
    "Task: pick up the red cube, State: 12 128 255 0 7;\nAction: ",
    "Task: insert the peg into the socket, State: 64 65 66 200 1;\nAction: ",
    "Task: fold the towel, State: 3 99 180 42 17;\nAction: ",
    "Task: transfer the cube to the other arm, State: 250 251 252 253 254;\nAction: ",
    "the quick brown fox jumps over the lazy dog 0123456789",
] * 20


def train_sentencepiece(prefix: Path, corpus: list[str], vocab_size: int, **options: Any) -> Path:
    """A small BPE SentencePiece model trained on `corpus` (skips the test without sentencepiece), with
    SentencePiece's own defaults unless `options` say otherwise; the path of its .model file."""
    sentencepiece = pytest.importorskip("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        minloglevel=2,
        **options,
    )
    return Path(f"{prefix}.model")


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 100-piece SentencePiece model laid out like PaliGemma's.

    Same special ids (pad 0, eos 1, bos 2, unk 3), and like Gemma it keeps text as is (identity
    normalisation, whitespace kept, "\n" a piece of its own) so the prompt's newline survives.
    """
    return train_sentencepiece(
        tmp_path_factory.mktemp("spm") / "tokenizer",
        _CORPUS,
        100,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["\n"],
    )


@pytest.fixture
def block_imports(monkeypatch: pytest.MonkeyPatch):
    """block_imports(*names): those packages cannot be imported (as if not installed) until the test ends."""

    def block(*names: str) -> None:
        class Blocker:
            def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
                if name.split(".")[0] in names:
                    raise ModuleNotFoundError(f"No module named {name!r}")

        monkeypatch.setattr(sys, "meta_path", [Blocker(), *sys.meta_path])
        for name in names:
            monkeypatch.delitem(sys.modules, name, raising=False)

    return block


def ros_domain(offset: int = 0) -> int:
    """The test run's DDS domain (ROS_DOMAIN_ID) moved by `offset`, for tests that keep their nodes apart,
    within 0..232 (Fast DDS refuses higher ones by ending the process without a word; found in review)."""
    return (int(os.environ.get("ROS_DOMAIN_ID", "42")) + offset) % 233
