#!/usr/bin/env bash
# Installs the system programs the end-to-end tests drive, when they are missing:
# tmux (the chat CLI in a real terminal), chromium (the web page), systemd-analyze (the unit).
# Needs root and Debian's package manager; elsewhere it says what is missing and carries on
# (the tests that need a missing program skip, naming it).
set -u
missing=()
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> Installing test tools: ${missing[*]}"
  apt-get update -qq >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || echo "warning: could not install ${missing[*]}; tests that need them will skip"
else
  echo "note: ${missing[*]} not installed and cannot install here; tests that need them will skip"
fi
exit 0
