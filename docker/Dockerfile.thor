# The `tensorrt` backend's environment for a Jetson AGX Thor (JetPack 7: CUDA 13, Python 3.12, arm64).
#
# NOT BUILT HERE: neither the development machine nor the H200 we measure on can pull NVIDIA's images
# or install TensorRT. The base is an NGC PyTorch image, which carries PyTorch and TensorRT's Python
# bindings; pick the tag whose CUDA matches the Thor's JetPack (override with --build-arg BASE=...).
# The build fails early, naming what is missing, if the base lacks either.
#
#   docker build -f docker/Dockerfile.thor -t rmuscle_ros:thor .
#   docker run --rm --runtime nvidia -v /opt/rmuscle:/opt/rmuscle -v rmuscle-cache:/root/.cache/rmuscle_ros \
#       rmuscle_ros:thor python -m rmuscle_ros.engine.tensorrt --preset pi05 \
#       --checkpoint /opt/rmuscle/models/pi05_aloha/model.safetensors
#
# That command exports the ONNX stages, builds the three engines (cached in the volume, keyed by weights,
# shapes, GPU and TensorRT version), compares one call with eager bfloat16 and times 20 calls. The ROS
# node on the Thor uses the system's ROS 2 Jazzy (apt, not the PyPI wheels, which are x86_64 only) with
# `model.backend: tensorrt`.
ARG BASE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE}

RUN python3 -c "import tensorrt, torch; print('TensorRT', tensorrt.__version__, 'torch', torch.__version__)" \
    || (echo "the base image needs PyTorch and TensorRT's Python bindings: pass --build-arg BASE=<an NGC PyTorch image>" && exit 1)

# The graph backend (config/rmuscle_thor.yaml) compiles its Triton kernels for the Thor's sm_110a, which
# came with CUDA 13: Triton 3.6's bundled ptxas does not know it (the engine refuses to start and names this
# variable). A pull request for Triton 3.7 reads TRITON_PTXAS_THOR_PATH for sm_110 instead, so both are set.
# Triton 3.6 falls back to its own ptxas when the path does not exist.
ENV TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas \
    TRITON_PTXAS_THOR_PATH=/usr/local/cuda/bin/ptxas
# This image has no ROS: the node runs on the Thor's own ROS 2 Jazzy (README, "On a Jetson Thor"). Where
# this image runs the graph backend (benchmarks, tests), its compiled kernels go under engine_cache_dir/triton:
# mount a volume there, or every container start compiles them all again. Engines built here are keyed by
# this image's TensorRT version; a node on the host builds its own.

WORKDIR /opt/rmuscle_ros
COPY pyproject.toml setup.py README.md package.xml ./
COPY resource ./resource
COPY config ./config
COPY launch ./launch
COPY libexec ./libexec
COPY rmuscle_ros ./rmuscle_ros
# The base's torch stays: --no-deps for the package, then only what it needs beyond the base.
# NGC images since 25.03 pin every package they ship in /etc/pip/constraint.txt, and pip applies it to
# build dependencies too: the package's build needs setuptools>=77 (pyproject.toml), which a pinned older
# one would refuse. PIP_CONSTRAINT= empties it for these two installs only (found in review; not built here).
# onnx, onnxscript and onnx-ir: the versions the export's tests ran with on 2026-12-03 (dev machine); another
# exporter version may emit other ops than the ones checked against TensorRT's ONNX parser.
RUN PIP_CONSTRAINT= pip install --no-cache-dir --no-deps -e . \
    && PIP_CONSTRAINT= pip install --no-cache-dir "safetensors>=0.4" "pyyaml>=6" "pillow>=10" "simplejpeg>=1.7" \
       "sentencepiece>=0.2" "onnx==1.23.2" "onnxscript==0.7.2" "onnx-ir==1.1.0"
