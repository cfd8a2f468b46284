#!/usr/bin/env bash
# One entry point for a fresh machine: installs what Voxtide needs, then runs a command.
#   scripts/dev.sh serve [args]   the server on the embedded tiny.en model
#   scripts/dev.sh test [args]    the test suite
#   scripts/dev.sh run CMD...     any command inside the virtualenv
# The virtualenv lives outside the clone, keyed on a hash of pyproject.toml, so CI and
# later runs reuse it (VOXTIDE_VENV_ROOT moves it).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES="pocketsphinx-testdata espeak-ng flite festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts sox chromium chromium-driver asterisk-core-sounds-en-wav asterisk-core-sounds-en"
root="${VOXTIDE_VENV_ROOT:-$HOME/.cache/voxtide}"
key=$( (cat pyproject.toml; python3 --version) | sha256sum | cut -c1-16)
venv="$root/venv-$key"

install_apt() {
  local missing=()
  for p in $APT_PACKAGES; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

install_venv() {
  if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
    "$venv/bin/pip" install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
    return 0
  fi
  rm -rf "$venv"
  mkdir -p "$root"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip setuptools wheel
  "$venv/bin/pip" install -q -e ".[test]"
  touch "$venv/.complete"
  # keep one environment: drop those of earlier pyproject.toml versions
  find "$root" -maxdepth 1 -name 'venv-*' ! -path "$venv" -exec rm -rf {} + 2>/dev/null || true
}

cmd="${1:-test}"
shift || true
case "$cmd" in
  test)
    install_apt
    install_venv
    exec "$venv/bin/python" -m pytest -q "$@"
    ;;
  serve)
    install_venv
    exec "$venv/bin/voxtide" serve "$@"
    ;;
  run)
    install_apt
    install_venv
    PATH="$venv/bin:$PATH" exec "$@"
    ;;
  env)
    echo "$venv"
    ;;
  *)
    echo "usage: scripts/dev.sh {serve|test|run CMD...|env}" >&2
    exit 2
    ;;
esac
