#!/usr/bin/env bash
# Downloads guidellm 0.8.1 and the dependencies the GPU image lacks, as wheels for CPython 3.12 on manylinux
# x86-64, into ./.whl/guidellm (apart from ./.whl, whose pins differ: guidellm needs click~=8.4). torch is left
# out on purpose: guidellm requires it unpinned and the GPU image's CUDA build satisfies it. So are the GPU
# image's own transformers, tokenizers, safetensors, numpy, protobuf (../shared/tools/gpu-wheels.sh lists them),
# and its pyarrow and pandas (datasets needs pyarrow >= 24: `python3 -c 'import pyarrow; print(pyarrow.__version__)'`
# there; if older, `bench/fetch_wheels.sh pyarrow==26.0.1` adds it, 53 MiB: carry that wheel in a call of its own).
# The set was read off `pip install guidellm` into a venv over this machine's torch (no CUDA torch pulled).
# Size, measured 2026-11-24: 18 MiB (with pyarrow and pandas it was 82 MiB, over a device call's 64 MiB).
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/guidellm .whl/guidellm/*.whl
#   GUIDELLM="env PYTHONPATH=/tmp/guidellm python3 -m guidellm" bench/outside_load.sh URL TOKENIZER_DIR OUT_DIR
set -euo pipefail
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl/guidellm
pkgs=(guidellm==0.8.1 aiofiles==25.1.0 aiologic==0.17.1 annotated-doc==0.0.7 annotated-types==0.7.0 anyio==4.16.0
      certifi click==8.4.2 culsans==0.10.0 datasets==5.2.0 dill==0.4.1 eval-type-backport==0.4.0 faker==40.54.0
      ftfy==6.3.1 h11==0.16.0 h2==4.4.1 hpack==4.2.0 html5tagger==2.0.0 httpcore==1.0.9 httptools==0.9.0
      httpx==0.28.1 hyperframe==6.1.0 idna loguru==0.7.3 markdown-it-py mdurl more-itertools==11.2.1 msgpack==1.2.4
      multidict==6.9.1 multiprocess==0.70.19 pydantic==2.13.4 pydantic-core==2.46.4
      pydantic-settings==2.14.1 pygments python-dateutil python-dotenv rich sanic==25.12.1 sanic-routing==23.12.0
      six sniffio tabulate==0.10.0 tracerite==2.6.5 typing-extensions typing-inspection ujson==6.1.0 uvloop==0.23.0
      wcwidth websockets==17.4 xxhash==4.1.0 fsspec filelock pyyaml tqdm "$@")
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl/guidellm "$p"
done
du -sh .whl/guidellm
