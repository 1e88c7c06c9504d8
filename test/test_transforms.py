"""π0.5 input transforms: image resize/pad, state discretisation, prompt, tokenisation, padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rmuscle_ros.models.tokenizer import ByteTokenizer
from rmuscle_ros.runtime.transforms import (
    ImageUploads,
    TokenizedPrompt,
    build_prompt,
    discretize_state,
    image_to_model,
    image_to_model_padded,
    images_to_model_padded,
    pad_to_dim,
    resize_with_pad,
    tokenize_prompt,
)


def _random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


# --- resize_with_pad ---------------------------------------------------------------------------


def test_resize_aloha_frame_is_letterboxed() -> None:
    # 480x640 -> ratio 640/224: content 168x224, 28 black rows above and below.
    image = _random_image(480, 640)
    out = resize_with_pad(image)
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8
    assert not out[:28].any() and not out[196:].any()

    chw = torch.from_numpy(image).permute(2, 0, 1)[None].float()
    expected = F.interpolate(chw, size=(168, 224), mode="bilinear", align_corners=False)
    expected_u8 = expected.round().clamp(0, 255).byte()[0].permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(out[28:196], expected_u8)


def test_resize_tall_image_pads_left_right_with_remainder_on_right() -> None:
    # 300x101 -> ratio 300/224: content 224 x int(101/ratio) = 75 wide; pad 149 -> 74 left, 75 right.
    out = resize_with_pad(np.full((300, 101, 3), 200, dtype=np.uint8))
    columns_with_content = np.flatnonzero(out.any(axis=(0, 2)))
    assert columns_with_content.tolist() == list(range(74, 74 + 75))
    assert (out[:, 74:149] == 200).all()


def test_resize_upscales_small_images() -> None:
    out = resize_with_pad(np.full((2, 4, 3), 255, dtype=np.uint8))
    # 2x4 -> 112x224: rows 56..167 filled.
    assert (out[56:168] == 255).all() and not out[:56].any() and not out[168:].any()


def test_resize_same_size_is_returned_untouched() -> None:
    image = _random_image(224, 224)
    assert resize_with_pad(image) is image


def test_resize_custom_size_and_degenerate_aspect() -> None:
    assert resize_with_pad(_random_image(10, 20), size=8).shape == (8, 8, 3)
    # 1x1000 would give a zero-height image in the reference formula; we keep one row.
    out = resize_with_pad(_random_image(1, 1000))
    assert out.shape == (224, 224, 3)


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (np.zeros((224, 224), dtype=np.uint8), "shape"),
        (np.zeros((224, 224, 4), dtype=np.uint8), "shape"),
        (np.zeros((224, 224, 3), dtype=np.float32), "dtype"),
        (np.zeros((0, 5, 3), dtype=np.uint8), "1x1"),
        (np.zeros((5, 0, 3), dtype=np.uint8), "1x1"),  # found by a mutation review: a RuntimeError from torch
        ([[[0, 0, 0]]], "numpy array"),
    ],
)
def test_resize_rejects_bad_images(image: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resize_with_pad(image)


@pytest.mark.parametrize("size", [0, -224, True, 224.0])
def test_resize_rejects_a_size_that_is_no_positive_int(size: object) -> None:
    """A bad output size is refused naming it, not met by a ZeroDivisionError or a float-sized buffer
    (found by a mutation review: size 0 passed the check and divided by zero)."""
    with pytest.raises(ValueError, match="size must be a positive int"):
        resize_with_pad(_random_image(4, 6), size=size)  # type: ignore[arg-type]


def test_resize_truncates_like_the_reference_and_pads_the_odd_row_and_column_last() -> None:
    """A 225 x 225 frame fits as 223 x 223 (openpi's and LeRobot's int truncation, not rounding), and the
    one padded row and column go to the bottom and right: the checkpoint sees the pixel grid it was
    trained on, not one a row or column off. Found by a mutation review (rounding, or the odd row on
    top, passed the suite)."""
    out = resize_with_pad(np.full((225, 225, 3), 200, dtype=np.uint8))
    assert (out[:223, :223] == 200).all()
    assert not out[223].any() and not out[:, 223].any()


def test_resize_keeps_one_column_of_a_one_pixel_wide_image() -> None:
    """The transposed case of 1 x 1000: a 1000 x 1 frame keeps one column, centered, rather than failing
    on a zero-width resize (found by a mutation review: only the height's guard was tested)."""
    out = resize_with_pad(np.full((1000, 1, 3), 90, dtype=np.uint8))
    assert out.shape == (224, 224, 3)
    assert np.flatnonzero(out.any(axis=(0, 2))).tolist() == [111]
    assert (out[:, 111] == 90).all()


# --- image_to_model ----------------------------------------------------------------------------


def test_image_to_model_layout_and_range() -> None:
    image = _random_image(224, 224)
    image[0, 0] = (0, 128, 255)
    tensor = image_to_model(image)
    assert tensor.shape == (3, 224, 224) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor[:, 0, 0].tolist() == pytest.approx([-1.0, 128 / 255 * 2 - 1, 1.0], abs=1e-6)
    expected = image.astype(np.float32) / 255.0 * 2.0 - 1.0
    np.testing.assert_array_equal(tensor.permute(1, 2, 0).numpy(), expected)


@pytest.mark.parametrize(
    ("height", "width"), [(480, 640), (224, 224), (225, 300), (300, 101), (1, 1000), (7, 5)]
)
def test_image_to_model_padded_is_the_two_steps_bit_for_bit(height: int, width: int) -> None:
    """The policy's one-step image path equals resize_with_pad then image_to_model exactly, also when
    written into a slice of a bigger buffer (the policy's camera slots)."""
    image = _random_image(height, width, seed=height * width)
    expected = image_to_model(resize_with_pad(image))
    assert torch.equal(image_to_model_padded(image), expected)
    slots = torch.full((2, 3, 224, 224), 7.0)
    image_to_model_padded(image, out=slots[1])
    assert torch.equal(slots[1], expected) and (slots[0] == 7.0).all()


def test_images_to_model_padded_batches_cameras_bit_for_bit() -> None:
    """The policy's path for all cameras at once: images of one size resampled as one batch, each slot
    exactly image_to_model_padded of its image, for consecutive and scattered slots and mixed sizes;
    slots without an image are left untouched; a bad image is refused before anything is written."""
    images = {
        0: _random_image(480, 640, seed=1),
        1: _random_image(480, 640, seed=2),
        3: _random_image(480, 640, seed=3),
    }
    images[5] = _random_image(300, 101, seed=4)
    images[6] = _random_image(224, 224, seed=5)
    out = torch.full((7, 3, 224, 224), 7.0)
    images_to_model_padded(images, out)
    for slot, image in images.items():
        assert torch.equal(out[slot], image_to_model_padded(image)), slot
    assert (out[2] == 7.0).all() and (out[4] == 7.0).all()
    out = torch.full((3, 3, 224, 224), 7.0)
    images_to_model_padded({0: images[0], 1: images[1], 2: images[3]}, out)  # the usual case: one write
    assert all(torch.equal(out[i], image_to_model_padded(images[j])) for i, j in ((0, 0), (1, 1), (2, 3)))
    out.fill_(7.0)
    with pytest.raises(ValueError, match="dtype uint8"):
        images_to_model_padded({0: images[0], 1: images[1].astype(np.float32)}, out)
    assert (out == 7.0).all()


def _textured_image() -> np.ndarray:
    """A camera-like frame: gradients, fine stripes (cloth, cables) and sensor noise."""
    y, x = np.mgrid[0:480, 0:640]
    image = np.stack([(x * 0.4) % 256, (y * 0.5) % 256, ((x + y) * 0.2) % 256], -1)
    image = image + 40 * np.sin(x / 1.5)[..., None] + np.random.default_rng(0).normal(0, 8, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def test_antialias_resizes_as_pil_does_for_openpi_checkpoints() -> None:
    """openpi shrinks its images with PIL's bilinear filter, which smooths; PyTorch's plain bilinear (as
    LeRobot) does not, and on fine texture the two differ by much of the range. With antialias every
    pixel is within 1 of 255 of PIL's, padding and placement the same."""
    from PIL import Image

    for image in (_textured_image(), _random_image(480, 640, seed=3)):
        pil = np.zeros((224, 224, 3), np.uint8)
        pil[28:196] = np.asarray(Image.fromarray(image).resize((224, 168), resample=Image.BILINEAR))
        ours = resize_with_pad(image, antialias=True).astype(int)
        assert np.abs(ours - pil).max() <= 1
        assert np.abs(resize_with_pad(image).astype(int) - pil).max() > 20, "plain bilinear differs"
        assert torch.equal(
            image_to_model_padded(image, antialias=True),
            image_to_model(resize_with_pad(image, antialias=True)),
        )
    images = {0: _textured_image(), 1: _random_image(480, 640, seed=3), 2: _random_image(300, 101, seed=4)}
    out = torch.empty(3, 3, 224, 224)
    images_to_model_padded(images, out, antialias=True)
    assert all(torch.equal(out[i], image_to_model_padded(images[i], antialias=True)) for i in images)


def test_images_to_model_padded_off_the_cpu_needs_uploads() -> None:
    """Into a tensor that is not on the CPU the frames must be uploaded first: without an ImageUploads the
    call says so; an ImageUploads is for a CUDA device only."""
    with pytest.raises(ValueError, match="needs uploads"):
        images_to_model_padded({0: _random_image(480, 640)}, torch.empty(1, 3, 224, 224, device="meta"))
    with pytest.raises(ValueError, match="CUDA device"):
        ImageUploads(torch.device("cpu"))


GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on the device machine)"
)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize(
    ("height", "width"), [(480, 640), (300, 101), (120, 160), (224, 224), (225, 225), (640, 480)]
)
@pytest.mark.parametrize("antialias", [False, True])
def test_images_to_model_padded_on_the_gpu_is_the_cpu_path_bit_for_bit(
    height: int, width: int, antialias: bool
) -> None:
    """The policy's path with the engine on a GPU (frames uploaded as uint8, resampled there) gives the
    CPU path's tensors exactly, for consecutive and scattered slots; a slot without an image is left as
    it was. Antialiased, PyTorch's CUDA and CPU kernels sum the filter taps in another order: on the H200
    5.7e-5 of the values came out one level (of 255) apart, so that path is held to one level."""
    images = {slot: _random_image(height, width, seed=10 * slot + height) for slot in range(3)}
    images[4] = _random_image(height, width, seed=99)  # a scattered slot: written on its own
    cpu = torch.full((5, 3, 224, 224), 7.0)
    images_to_model_padded(images, cpu, antialias=antialias)
    out = torch.full((5, 3, 224, 224), 7.0, device="cuda")
    images_to_model_padded(images, out, ImageUploads(torch.device("cuda")), antialias)
    gpu = out.cpu()
    assert (gpu[3] == 7.0).all(), "a slot without an image is left as it was"
    if antialias:
        level = 2.0 / 255.0  # one of 255 in the model's [-1, 1]
        assert (gpu - cpu).abs().max().item() <= level * 1.001
        assert (gpu != cpu).float().mean().item() < 1e-3
        return
    assert torch.equal(gpu, cpu), f"{(gpu != cpu).float().mean().item():.2e} of the values differ"


@pytest.mark.gpu
@GPU
def test_image_uploads_reuse_their_buffers_without_mixing_calls() -> None:
    """Frames uploaded call after call, nothing waited on between: each upload holds its own frames (a
    pinned buffer is rewritten only once the GPU has read it); a fifth new shape frees the oldest buffer."""
    uploads = ImageUploads(torch.device("cuda"), max_shapes=4)
    frames = [[_random_image(480, 640, seed=3 * i + j) for j in range(3)] for i in range(6)]
    on_device = [uploads.upload(f) for f in frames]  # queued back to back
    for f, d in zip(frames, on_device, strict=True):
        assert np.array_equal(d.cpu().numpy(), np.stack(f))
    for k in range(5):
        frame = _random_image(100 + k, 100, seed=k)
        assert np.array_equal(uploads.upload([frame]).cpu().numpy()[0], frame)
    assert len(uploads._buffers) == 4


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("antialias", [False, True])
def test_resampling_replayed_as_a_graph_gives_each_calls_own_images(antialias: bool) -> None:
    """From a batch's second call on, `ImageUploads.fill` replays the resampling its first call captured
    (the policy fills one output tensor call after call): with new frames each call, nothing waited on
    between, each result is what the same operations launched one by one give, bit for bit. A camera
    missing (other slots) or another size captures its own graph; a fifth frees the oldest."""
    cuda = torch.device("cuda")
    graphs, one_by_one = ImageUploads(cuda, max_shapes=4), ImageUploads(cuda, graphs=False)
    out, want = (torch.full((5, 3, 224, 224), 7.0, device=cuda) for _ in range(2))
    seen = []
    for call in range(6):
        # slots 0-2 and 4 (one size: one batch, written slot by slot), slot 1 missing in calls 3 and 4
        images = {slot: _random_image(480, 640, seed=10 * call + slot) for slot in (0, 1, 2, 4)}
        if call in (3, 4):
            del images[1]
        images_to_model_padded(images, out, graphs, antialias)
        images_to_model_padded(images, want, one_by_one, antialias)
        seen.append((out.clone(), want.clone()))  # queued: read only at the end
    for call, (got, expected) in enumerate(seen):
        assert torch.equal(got, expected), f"call {call}"
    assert len(graphs._resamplings) == 2 and not one_by_one._resamplings
    for k in range(3):  # three new sizes: four graphs kept, the oldest freed once its last replay ran
        for _ in range(2):  # captured, then replayed
            frame = {0: _random_image(100 + k, 120, seed=k)}
            images_to_model_padded(frame, out, graphs, antialias)
            images_to_model_padded(frame, want, one_by_one, antialias)
            assert torch.equal(out, want)
    assert len(graphs._resamplings) == 4


@pytest.mark.gpu
@GPU
def test_a_resampling_graph_that_cannot_be_captured_leaves_the_launches_one_by_one(
    monkeypatch, caplog
) -> None:
    """A capture that fails (out of memory during it, say) does not fail the call, whose images were in place
    before it: the uploads say so once and launch the operations one by one from then on."""
    cuda = torch.device("cuda")
    uploads, one_by_one = ImageUploads(cuda), ImageUploads(cuda, graphs=False)

    def fails(*_args: object) -> None:
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(uploads, "_capture", fails)
    out, want = (torch.full((3, 3, 224, 224), 7.0, device=cuda) for _ in range(2))
    for call in range(3):
        images = {slot: _random_image(480, 640, seed=10 * call + slot) for slot in range(3)}
        with caplog.at_level("WARNING"):
            images_to_model_padded(images, out, uploads, False)
        images_to_model_padded(images, want, one_by_one, False)
        assert torch.equal(out, want), f"call {call}"
    assert not uploads.graphs and not uploads._resamplings
    said = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(said) == 1 and "out of memory (simulated)" in said[0], said


def test_image_to_model_requires_resized_input() -> None:
    with pytest.raises(ValueError, match="resize_with_pad"):
        image_to_model(_random_image(480, 640))


# --- discretize_state --------------------------------------------------------------------------


def test_discretize_state_bins() -> None:
    state = np.array([-1.5, -1.0, -0.99, 0.0, 0.5, 0.99, 1.0, 1.5], dtype=np.float32)
    bins = discretize_state(state)
    assert bins.dtype == np.int64
    # bin width 2/256 = 1/128: -0.99 is 0.01 above -1 (bin 1); 0 -> 128; 0.5 -> 192; >= 1 - 1/128 -> 255.
    assert bins.tolist() == [-1, 0, 1, 128, 192, 254, 255, 255]


def test_discretize_state_keeps_shape() -> None:
    assert discretize_state(np.zeros((2, 3))).shape == (2, 3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_discretize_state_rejects_non_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        discretize_state(np.array([0.0, bad]))


# --- build_prompt / tokenize_prompt ------------------------------------------------------------


def test_build_prompt_format() -> None:
    prompt = build_prompt("  pick_up the\ncube \n", np.array([0, 128, 255, -1]))
    assert prompt == "Task: pick up the cube, State: 0 128 255 -1;\nAction: "


def test_build_prompt_rejects_float_state() -> None:
    with pytest.raises(ValueError, match="integer"):
        build_prompt("task", np.array([0.5]))


def test_build_prompt_rejects_a_state_that_is_not_one_row() -> None:
    """A (2, 7) array of bins would be written into the prompt as nested lists ("[1, 2, ...]"), text the
    checkpoint never saw: refused instead (found by a mutation review)."""
    with pytest.raises(ValueError, match="1-D integer array"):
        build_prompt("task", np.zeros((2, 7), dtype=np.int64))


def test_tokenize_prompt_pads_right() -> None:
    tokenizer = ByteTokenizer()
    result = tokenize_prompt(tokenizer, "ab", max_len=6)
    assert isinstance(result, TokenizedPrompt)
    assert result.tokens.dtype == np.int64 and result.mask.dtype == np.bool_
    assert result.tokens.tolist() == [2, 3 + 97, 3 + 98, 0, 0, 0]
    assert result.mask.tolist() == [True, True, True, False, False, False]
    assert (result.truncated, result.num_tokens) == (False, 3)


def test_tokenize_prompt_exact_fit_is_not_truncated() -> None:
    result = tokenize_prompt(ByteTokenizer(), "abc", max_len=4)
    assert result.mask.all() and not result.truncated and result.num_tokens == 4


def test_tokenize_prompt_truncates_and_flags() -> None:
    result = tokenize_prompt(ByteTokenizer(), "abcdef", max_len=4)
    assert result.tokens.tolist() == [2, 3 + 97, 3 + 98, 3 + 99]
    assert result.mask.all()
    assert result.truncated and result.num_tokens == 7


def test_tokenize_prompt_keep_longer_than_max_len_keeps_max_len() -> None:
    """`keep` (the checkpoint's trained prompt length) past `max_len` cuts at max_len, flagged, instead of
    failing to fit the tokens into the row (found by a mutation review)."""
    result = tokenize_prompt(ByteTokenizer(), "abcdef", max_len=4, keep=10)
    assert result.tokens.tolist() == [2, 3 + 97, 3 + 98, 3 + 99]
    assert result.mask.all() and result.truncated and result.num_tokens == 7


@pytest.mark.parametrize(("max_len", "keep"), [(0, None), (4, 0), (True, None), (4, 2.0)])
def test_tokenize_prompt_rejects_lengths_that_are_no_positive_int(max_len: object, keep: object) -> None:
    """A zero-length prompt row would run the model on no tokens at all: refused naming the argument
    (found by a mutation review: 0 passed the check)."""
    with pytest.raises(ValueError, match="must be a positive int"):
        tokenize_prompt(ByteTokenizer(), "ab", max_len=max_len, keep=keep)  # type: ignore[arg-type]


def test_tokenized_prompt_validates_consistency() -> None:
    with pytest.raises(ValueError, match="truncated"):
        TokenizedPrompt(np.zeros(3, np.int64), np.ones(3, np.bool_), truncated=False, num_tokens=5)
    with pytest.raises(ValueError, match="mask"):
        TokenizedPrompt(np.zeros(3, np.int64), np.array([False, True, False]), truncated=False, num_tokens=1)


def test_full_prompt_pipeline_with_byte_tokenizer() -> None:
    prompt = build_prompt("fold_towel", discretize_state(np.array([-1.0, 0.0, 0.999])))
    assert prompt == "Task: fold towel, State: 0 128 255;\nAction: "
    result = tokenize_prompt(ByteTokenizer(), prompt, max_len=200)
    assert result.num_tokens == len(prompt) + 1 and not result.truncated


# --- pad_to_dim --------------------------------------------------------------------------------


def test_pad_to_dim() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    padded = pad_to_dim(x, 5)
    assert padded.shape == (2, 5) and padded.dtype == np.float32
    np.testing.assert_array_equal(padded[:, :3], x)
    assert not padded[:, 3:].any()
    assert pad_to_dim(x, 3) is x
    with pytest.raises(ValueError, match="more than the target dim 2"):
        pad_to_dim(x, 2)
