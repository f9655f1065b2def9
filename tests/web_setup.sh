#!/usr/bin/env bash
# Installs what tests/test_web.py needs: Debian's chromium (and chromium-driver) through apt,
# and the pinned `playwright` Python package, which drives /usr/bin/chromium. Nothing here
# downloads a browser build of its own (never run `playwright install`).
#
# Usage: bash tests/web_setup.sh        (CI calls it before pytest; safe to run again)
# If chromium cannot be installed (no root, no apt, no network), this says so and exits 0:
# tests/test_web.py then skips with a message that names this script.
set -u

PLAYWRIGHT_VERSION="1.65.2"
PYTHON="${PYTHON:-python}"

if [ -x /usr/bin/chromium ]; then
  echo "web_setup: chromium present: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
else
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "web_setup: installing chromium and chromium-driver with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; then
      echo "web_setup: installed $(/usr/bin/chromium --version 2>/dev/null | head -1)"
    else
      echo "web_setup: WARNING: apt-get could not install chromium; the browser tests will skip"
    fi
  else
    echo "web_setup: WARNING: chromium missing and not root with apt-get; install the Debian packages" \
         "'chromium' and 'chromium-driver' by hand, or the browser tests skip"
  fi
fi

if "$PYTHON" -c "import playwright, sys; from importlib.metadata import version; sys.exit(version('playwright') != '$PLAYWRIGHT_VERSION')" 2>/dev/null; then
  echo "web_setup: playwright $PLAYWRIGHT_VERSION present"
else
  echo "web_setup: installing playwright==$PLAYWRIGHT_VERSION (the Python driver only, no browser download)"
  "$PYTHON" -m pip install -q "playwright==$PLAYWRIGHT_VERSION" || echo "web_setup: WARNING: pip could not install playwright"
fi
exit 0
