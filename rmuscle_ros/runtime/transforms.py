"""π0.5 input transforms, applied in this order: resize images, discretise state, build and tokenise the
prompt, pad state/actions to the model's dimension.

Each step is a small pure function so that it can be tested against the reference behaviour of openpi
and LeRobot (see shared/reference/pi05_architecture.md, "State tokenization" and "resize_with_pad").
The state reaching `discretize_state` must already be quantile-normalised (`runtime.normalize`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rmuscle_ros.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MODEL_IMAGE_SIZE = 224
STATE_BINS = 256


def check_rgb_u8(image: np.ndarray, name: str = "image") -> None:
    """Raise ValueError saying what is wrong unless `image` is an (H, W, 3) uint8 array of at least 1x1."""
    if not isinstance(image, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(image).__name__}")
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"{name} must have shape (H, W, 3), got {image.shape}")
    if image.dtype != np.uint8:
        raise ValueError(f"{name} must have dtype uint8, got {image.dtype}")
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"{name} must be at least 1x1 pixels, got {image.shape}")


def _fitted_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(new_h, new_w) of the aspect-preserving fit into size x size.

    Same arithmetic as openpi and LeRobot, truncation included: for some input sizes (e.g. 225) the long
    side comes out as size - 1 and gets one padded row/column, and we keep that for parity.
    """
    ratio = max(width / size, height / size)
    # max(1, ...) only matters for extreme aspect ratios (e.g. 1 x 1000), where the reference would fail.
    return max(1, int(height / ratio)), max(1, int(width / ratio))


def _resized(image: np.ndarray, size: int, antialias: bool = False) -> tuple[torch.Tensor, int, int] | None:
    """The resampled pixels of `resize_with_pad`, rounded: (3, new_h, new_w) float32 holding integers in
    [0, 255], and the (top, left) corner they go to. None if the image is already size x size."""
    check_rgb_u8(image)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    height, width = image.shape[:2]
    if (height, width) == (size, size):
        return None
    new_h, new_w = _fitted_size(height, width, size)
    # interpolate works on (N, C, H, W) float; uint8 is resampled in float32 then rounded back, as the
    # reference PyTorch implementations do.
    chw = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    resized = F.interpolate(
        chw, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=antialias
    )
    return resized[0].round().clamp(0, 255), (size - new_h) // 2, (size - new_w) // 2


def resize_with_pad(image: np.ndarray, size: int = MODEL_IMAGE_SIZE, antialias: bool = False) -> np.ndarray:
    """Fit an RGB image into size x size: aspect-preserving bilinear resize, then centered zero padding.

    Args:
        image: (H, W, 3) uint8, any H, W >= 1.
        size: output side in pixels.
        antialias: smooth while shrinking, as PIL's bilinear filter does (openpi resizes with PIL, LeRobot
            with PyTorch's plain bilinear: the default). Within 1 of 255 of PIL's pixels.

    Returns:
        (size, size, 3) uint8. An input that is already (size, size, 3) is returned as is (same object,
        not resampled). Padding is 0 (black); top/left get (size - new) // 2, bottom/right the rest.
    """
    fitted = _resized(image, size, antialias)
    if fitted is None:
        return image
    pixels, top, left = fitted
    padded = np.zeros((size, size, 3), dtype=np.uint8)
    hwc = pixels.to(torch.uint8).permute(1, 2, 0).numpy()
    padded[top : top + hwc.shape[0], left : left + hwc.shape[1]] = hwc
    return padded


def image_to_model_padded(
    image: np.ndarray,
    size: int = MODEL_IMAGE_SIZE,
    out: torch.Tensor | None = None,
    antialias: bool = False,
) -> torch.Tensor:
    """image_to_model(resize_with_pad(image, size, antialias)) bit for bit, without the uint8 (size, size,
    3) intermediate: the rounded pixels are scaled where they land, the padding is -1.0 (black). Writes
    into out (3, size, size) float32 if given (bench/bench_preprocess.py times both paths)."""
    fitted = _resized(image, size, antialias)
    if fitted is None:
        model = image_to_model(image, size)
        return model if out is None else out.copy_(model)
    pixels, top, left = fitted
    if out is None:
        out = torch.empty(3, size, size)
    out.fill_(-1.0)  # 0 / 255 * 2 - 1
    out[:, top : top + pixels.shape[1], left : left + pixels.shape[2]] = pixels / 255.0 * 2.0 - 1.0
    return out


def images_to_model_padded(
    images: dict[int, np.ndarray],
    out: torch.Tensor,
    uploads: ImageUploads | None = None,
    antialias: bool = False,
) -> None:
    """image_to_model_padded for several images at once: image `images[i]` into `out[i]` ((slots, 3, size,
    size) float32; slots not in `images` are left as they are). A bad image raises ValueError before
    anything is written.

    On the CPU, bit for bit image_to_model_padded's result. Images of the same size are resampled as one
    batch, so a call makes about a dozen PyTorch calls rather than a dozen per camera: each that releases
    the interpreter lock may then wait for another thread to hand it back (bench/bench_preprocess.py).

    With `out` on a GPU, `uploads` (required) copies the uint8 images there and the same operations run
    on the GPU, queued on the current stream: the host only copies the frames. The result is the CPU
    path's, bit for bit (test/test_transforms.py, on a GPU); antialiased, within one level of 255 (the
    CUDA kernel sums its taps in another order). `antialias`: as resize_with_pad's."""
    size = out.shape[-1]
    groups: dict[tuple[int, int], list[int]] = {}
    for slot, image in images.items():
        check_rgb_u8(image)
        groups.setdefault(image.shape[:2], []).append(slot)
    if out.device.type != "cpu":
        if uploads is None:
            raise ValueError(f"images_to_model_padded into {out.device} needs uploads (an ImageUploads)")
        for slots in groups.values():
            uploads.fill([images[slot] for slot in slots], out, slots, antialias)
        return
    for (height, width), slots in groups.items():
        if len(slots) == 1 or (height, width) == (size, size):
            for slot in slots:
                image_to_model_padded(images[slot], size, out=out[slot], antialias=antialias)
            continue
        batch = torch.from_numpy(np.stack([images[slot] for slot in slots]))
        _fill_padded(batch, out, slots, antialias=antialias)


def _fill_padded(
    batch: torch.Tensor,
    out: torch.Tensor,
    slots: list[int],
    full_scale: float | torch.Tensor = 255.0,
    antialias: bool = False,
) -> None:
    """(n, H, W, 3) uint8 images, on out's device -> out[slots], with the operations of _resized and
    image_to_model_padded (image_to_model's for images already size x size), in place on the batch.
    `full_scale`: 255, as ImageUploads.full_scale on a GPU."""
    size = out.shape[-1]
    height, width = batch.shape[1:3]
    pixels = batch.permute(0, 3, 1, 2).to(torch.float32)
    if (height, width) == (size, size):
        for j, slot in enumerate(slots):
            out[slot] = pixels[j].div_(full_scale).mul_(2.0).sub_(1.0)
        return
    new_h, new_w = _fitted_size(height, width, size)
    pixels = F.interpolate(
        pixels, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=antialias
    )
    pixels.round_().clamp_(0, 255).div_(full_scale).mul_(2.0).sub_(1.0)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    rows, cols = slice(top, top + new_h), slice(left, left + new_w)
    if _consecutive(slots):  # one write for all: the usual case
        block = out[slots[0] : slots[0] + len(slots)]
        block.fill_(-1.0)
        block[:, :, rows, cols] = pixels
        return
    for j, slot in enumerate(slots):
        out[slot].fill_(-1.0)
        out[slot, :, rows, cols] = pixels[j]


def _consecutive(slots: list[int]) -> bool:
    return slots == list(range(slots[0], slots[0] + len(slots)))


@dataclass
class _Resampling:
    """One batch shape's resampling into `out[slots]` as a CUDA graph: its input buffer on the device, and
    an event recorded after each replay (the buffer is rewritten, or the graph freed, once it has passed)."""

    frames: torch.Tensor
    graph: torch.cuda.CUDAGraph
    done: torch.cuda.Event


class ImageUploads:
    """Copies camera frames to a GPU through pinned host buffers, reused from call to call, and resamples
    them into the model's input there.

    A frame from a ROS message is pageable memory; copying it into a pinned buffer and queuing a DMA
    from there lets the host go on at once. One buffer per batch shape (cameras of one size share one),
    at most `max_shapes` of them (a stream of ever-new sizes frees the oldest). A buffer is rewritten
    only after the GPU has read its previous contents (an event per buffer).

    `fill` resamples a batch the first time with PyTorch's operations one by one, and captures them as a
    CUDA graph for the next calls of the same batch shape, slots, output and antialiasing: the same
    kernels (the same values, bit for bit), launched by one replay instead of about ten launches from
    Python on the call's path. At most `max_shapes` graphs are kept (the oldest freed), all in one memory
    pool (their scratch tensors live only within a replay, and replays follow each other on one stream);
    `graphs=False` keeps to the launches one by one, and so does a capture that fails (said once). Calls
    are serialised by the caller (the policy's lock), with `device` the current one."""

    def __init__(self, device: torch.device, max_shapes: int = 4, graphs: bool = True) -> None:
        if device.type != "cuda":
            raise ValueError(f"ImageUploads copies to a CUDA device, got {device}")
        self.device = device
        self.max_shapes = max_shapes
        self.graphs = graphs
        # 255 as a tensor on the device, to divide the pixels by: divided by a Python number, PyTorch's
        # CUDA kernels multiply by its reciprocal, which differed from the CPU's division by one ulp in 29 %
        # of the values (H200, 3 cameras); divided by a device tensor, they divide, as the CPU does.
        self.full_scale = torch.tensor(255.0, device=device)
        self._buffers: dict[tuple[int, ...], tuple[torch.Tensor, torch.cuda.Event]] = {}
        self._resamplings: dict[tuple, _Resampling] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def _staged(self, frames: list[np.ndarray]) -> tuple[torch.Tensor, torch.cuda.Event]:
        """`frames` in their shape's pinned buffer, once the GPU has read its previous contents; and the
        event to record after the copy that reads them is queued."""
        shape = (len(frames), *frames[0].shape)
        held = self._buffers.pop(shape, None)
        if held is None:
            if len(self._buffers) >= self.max_shapes:
                oldest = next(iter(self._buffers))
                self._buffers.pop(oldest)[1].synchronize()  # its last copy done before it is freed
            held = (torch.empty(shape, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
        host, copied = held
        copied.synchronize()  # the previous copy from this buffer has been read (at once if none)
        staging = host.numpy()
        for j, frame in enumerate(frames):
            np.copyto(staging[j], frame)
        self._buffers[shape] = held  # most recently used last
        return host, copied

    def upload(self, frames: list[np.ndarray]) -> torch.Tensor:
        """(n, H, W, 3) uint8 on the device: `frames` (each (H, W, 3) uint8, checked by the caller),
        copied on the current stream."""
        host, copied = self._staged(frames)
        on_device = host.to(self.device, non_blocking=True)
        copied.record(torch.cuda.current_stream(self.device))
        return on_device

    def fill(self, frames: list[np.ndarray], out: torch.Tensor, slots: list[int], antialias: bool) -> None:
        """`frames` (one size) resampled into `out[slots]` on the current stream (images_to_model_padded)."""
        key = (
            len(frames),
            *frames[0].shape,
            tuple(slots),
            antialias,
            out.data_ptr(),
            out.shape,
            out.stride(),
        )
        resampling = self._resamplings.get(key)
        if resampling is None:
            on_device = self.upload(frames)
            _fill_padded(on_device, out, slots, self.full_scale, antialias)
            if self.graphs:
                # A capture that fails (out of memory during it, say) leaves this call's result in place
                try:
                    captured = self._capture(on_device, out, slots, antialias)
                except RuntimeError as e:
                    self.graphs = False
                    log.warning(
                        "images: resampling as a CUDA graph failed (%s); launching it op by op from now on", e
                    )
                    return
                self._keep(key, captured)
            return
        host, copied = self._staged(frames)
        stream = torch.cuda.current_stream(self.device)
        resampling.done.synchronize()  # (passed already, normally) its input is read by the last replay
        resampling.frames.copy_(host, non_blocking=True)
        copied.record(stream)
        resampling.graph.replay()
        resampling.done.record(stream)
        del self._resamplings[key]
        self._resamplings[key] = resampling  # most recently used last

    def _capture(
        self, like: torch.Tensor, out: torch.Tensor, slots: list[int], antialias: bool
    ) -> _Resampling:
        """The resampling `fill` has just run, captured (not run) on a side stream: its kernels are loaded,
        so nothing is initialised during the capture. Other threads' CUDA work may go on meanwhile
        (thread-local capture mode)."""
        frames = torch.empty_like(like)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                _fill_padded(frames, out, slots, self.full_scale, antialias)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return _Resampling(frames, graph, torch.cuda.Event())

    def _keep(self, key: tuple, resampling: _Resampling) -> None:
        if len(self._resamplings) >= self.max_shapes:
            oldest = next(iter(self._resamplings))
            self._resamplings.pop(oldest).done.synchronize()  # its last replay done before it is freed
        self._resamplings[key] = resampling


def image_to_model(image_u8: np.ndarray, size: int = MODEL_IMAGE_SIZE) -> torch.Tensor:
    """(size, size, 3) uint8 RGB -> (3, size, size) float32 tensor in [-1, 1] (x / 255 * 2 - 1)."""
    check_rgb_u8(image_u8, "image_u8")
    if image_u8.shape[:2] != (size, size):
        raise ValueError(
            f"image_u8 must be {size}x{size} (run resize_with_pad first), got {image_u8.shape[:2]}"
        )
    # Same operation order as openpi (x / 255 then * 2 - 1) so results match bit for bit in float32.
    contiguous = np.ascontiguousarray(image_u8)
    if not contiguous.flags.writeable:  # torch.from_numpy warns on a read-only array (a frame's buffer)
        contiguous = contiguous.copy()
    chw = torch.from_numpy(contiguous).permute(2, 0, 1).to(torch.float32)
    return (chw / 255.0 * 2.0 - 1.0).contiguous()


def discretize_state(state_normalized: np.ndarray) -> np.ndarray:
    """Bin a normalised state into 256 bins over [-1, 1] for the text prompt.

    Args:
        state_normalized: float array, any shape, nominally in [-1, 1] (quantile-normalised).

    Returns:
        int64 array of the same shape. Values in [-1, 1] map to 0..255; values below -1 map to -1 and
        values above 1 to 255 (the reference clips nothing; -1 then appears in the prompt).
    """
    state = np.asarray(state_normalized)
    if not np.issubdtype(state.dtype, np.number) or np.issubdtype(state.dtype, np.complexfloating):
        raise ValueError(f"state must be a real numeric array, got dtype {state.dtype}")
    if not np.all(np.isfinite(state)):
        raise ValueError(f"state contains NaN or Inf: {state}")
    # Left bin edges -1, -1 + 2/256, ..., 1 - 2/256: digitize returns 1..256 inside [-1, 1].
    left_edges = np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]
    return (np.digitize(state, bins=left_edges) - 1).astype(np.int64)


def clean_task(task: str) -> str:
    """The task text as the prompt carries it: surrounding whitespace stripped, "_" and newlines as spaces.
    Two instructions with the same cleaned text are the same task to the model (and to rMuscle's library)."""
    return task.strip().replace("_", " ").replace("\n", " ")


def check_prompt(task: object) -> str:
    """`task` if a prompt may carry it: text (str) that encodes as UTF-8 and is not blank once cleaned
    (`clean_task`: "_" alone would read " "); otherwise a ValueError naming the problem."""
    if not isinstance(task, str):
        raise ValueError(f"prompt must be text (str), got {type(task).__name__}")
    try:
        task.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt is not valid text: {e.reason} at character {e.start}") from None
    if not clean_task(task).strip():
        raise ValueError(
            f"prompt {task!r} is blank once cleaned for the model ('_' and newlines read as spaces)"
        )
    return task


def build_prompt(task: str, discretized_state: np.ndarray) -> str:
    """The π0.5 prompt: "Task: <task>, State: <bins>;\\nAction: ".

    Args:
        task: free-text instruction; surrounding whitespace is stripped, "_" and newlines become spaces.
        discretized_state: (state_dim,) integer bins from `discretize_state`.
    """
    bins = np.asarray(discretized_state)
    if bins.ndim != 1 or not np.issubdtype(bins.dtype, np.integer):
        raise ValueError(
            f"discretized_state must be a 1-D integer array, got shape {bins.shape} dtype {bins.dtype}"
        )
    cleaned = clean_task(task)
    state_text = " ".join(str(b) for b in bins.tolist())
    return f"Task: {cleaned}, State: {state_text};\nAction: "


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt tokenised to a fixed length.

    tokens: (max_len,) int64, right-padded with the tokenizer's pad id.
    mask: (max_len,) bool, True for real tokens (a prefix of the row).
    truncated: the prompt had more tokens than were kept (max_len, or a shorter `keep`): its tail was dropped.
    num_tokens: token count of the full prompt before truncation (so it can exceed max_len);
        the kept count is `mask.sum()`, at most min(num_tokens, max_len).
    """

    tokens: np.ndarray
    mask: np.ndarray
    truncated: bool
    num_tokens: int

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.dtype != np.int64:
            raise ValueError(
                f"tokens must be 1-D int64, got shape {self.tokens.shape} dtype {self.tokens.dtype}"
            )
        if self.mask.shape != self.tokens.shape or self.mask.dtype != np.bool_:
            raise ValueError(f"mask must be bool with shape {self.tokens.shape}, got {self.mask.shape}")
        max_len, kept = self.tokens.shape[0], int(self.mask.sum())
        if (
            self.num_tokens < 0
            or kept > min(self.num_tokens, max_len)
            or self.truncated != (self.num_tokens > kept)
        ):
            raise ValueError(
                f"inconsistent truncated={self.truncated} for num_tokens={self.num_tokens}, {kept} kept, "
                f"max_len={max_len}"
            )
        if not self.mask[:kept].all():
            raise ValueError("mask must be True exactly on the first slots, one per kept token")


def tokenize_prompt(
    tokenizer: Tokenizer, prompt: str, max_len: int, keep: int | None = None
) -> TokenizedPrompt:
    """Tokenise `prompt` (BOS included) into exactly `max_len` slots, of which at most `keep` (default
    `max_len`: a checkpoint trained with shorter prompts is cut where its training cut them) hold tokens.

    Longer prompts are truncated like openpi does, and `truncated` is set so that the caller can log or
    count it instead of silently losing the end of the state.
    """
    keep = max_len if keep is None else keep
    for name, value in (("max_len", max_len), ("keep", keep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    keep = min(keep, max_len)
    ids = tokenizer.encode(prompt)
    num_tokens = len(ids)
    kept = min(num_tokens, keep)
    tokens = np.full(max_len, tokenizer.pad_id, dtype=np.int64)
    tokens[:kept] = ids[:kept]
    mask = np.zeros(max_len, dtype=np.bool_)
    mask[:kept] = True
    return TokenizedPrompt(tokens=tokens, mask=mask, truncated=num_tokens > keep, num_tokens=num_tokens)


def pad_to_dim(x: np.ndarray, dim: int) -> np.ndarray:
    """Zero-pad the last axis of `x` to `dim` (e.g. a 14-D ALOHA state to the model's 32).

    Returns `x` itself when its last axis is already `dim`; raises when it is larger.
    """
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError("pad_to_dim needs an array with at least one axis, got a scalar")
    current = x.shape[-1]
    if current > dim:
        raise ValueError(f"last axis has {current} entries, more than the target dim {dim}")
    if current == dim:
        return x
    padding = [(0, 0)] * (x.ndim - 1) + [(0, dim - current)]
    return np.pad(x, padding)
