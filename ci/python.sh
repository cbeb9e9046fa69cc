# Sourced by ci/main.sh, ci/test.sh and ci/setup.sh.  Picks the Python that hpct is built,
# installed, tested and run with, and exports it as PYTHON (ci/setup.sh installs into that one).
#
# In order: $PYTHON when set; an activated virtual environment; the first python3 on PATH
# that the OS does not manage (Debian's refuses pip installs, PEP 668); pyenv's python3.  A login
# shell may list /usr/bin before pyenv's shims, so "python3 on PATH" alone is not enough.  Where
# none of these is found (a fresh Debian 12 box: its only python3 is Debian's), the checkout's own
# virtual environment, .venv/ beside ci/ (made from that python3 on the first run, with Debian's
# python3-venv and python3-dev installed first; reused by every later run; delete it to start over).

# The system tools that the set-up installs and the tests run as root live in sbin (tc, sysctl,
# debootstrap, slurmctld, munged): a PATH without it (a clean `env -i` shell, a non-login one)
# made the image and Slurm tests skip as "not installed" and every htb link fail to exec tc.
for dir in /usr/local/sbin /usr/sbin /sbin; do
  case ":$PATH:" in *":$dir:"*) ;; *) PATH="$PATH:$dir" ;; esac
done
export PATH

hpct_os_managed() {   # true when pip may not install into interpreter $1
  "$1" - <<'PY'
import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if os.path.exists(marker) and sys.prefix == sys.base_prefix else 1)
PY
}

hpct_pick_python() {
  local p=""
  if [ -n "${PYTHON:-}" ]; then
    p=$(command -v "$PYTHON") || { echo "ci: PYTHON=$PYTHON is not an executable" >&2; return 1; }
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    p=$VIRTUAL_ENV/bin/python
  else
    # The first python3 on PATH that pip may install into: a PATH that lists /usr/bin before
    # pyenv's shims (a clean shell's) must not stop at Debian's.
    local c
    p=""
    while IFS= read -r c; do
      if ! hpct_os_managed "$c"; then p=$c; break; fi
      [ -n "$p" ] || p=$c
    done < <(type -ap python3 2>/dev/null)
    if { [ -z "$p" ] || hpct_os_managed "$p"; } && command -v pyenv >/dev/null 2>&1; then
      p=$(pyenv which python3 2>/dev/null || echo "$p")
    fi
  fi
  if [ -z "$p" ]; then
    echo "ci: no python3 found on PATH ($PATH)" >&2
    echo "  fix: install Python 3.11 or newer (or set PYTHON=/path/to/python3)" >&2
    return 1
  fi
  if hpct_os_managed "$p"; then
    if [ -n "${PYTHON:-}" ]; then       # chosen on purpose: never replaced behind the user's back
      echo "ci: $p is managed by the OS: pip refuses to install hpct, torch and the build tools into it" >&2
      echo "  fix: unset PYTHON (the ci scripts then make and use the checkout's .venv), or" \
           "python3 -m venv ~/hpct-venv && PYTHON=~/hpct-venv/bin/python bash $0" >&2
      return 1
    fi
    p=$(hpct_checkout_venv "$p") || return 1
  fi
  PYTHON=$p
  export PYTHON
}

HPCT_VENV_READY=.hpct-ready       # written last: a venv without it was cut short and is made again

# The checkout's virtual environment (.venv), made from the OS's interpreter $1 unless an earlier
# run made it; prints its python.  Debian ships venv's pip and Python's headers (the hpct wheel
# compiles an extension) in packages of their own, installed first where missing.
hpct_checkout_venv() {
  local base=$1 venv="$PWD/.venv" out
  if [ -f "$venv/$HPCT_VENV_READY" ] && "$venv/bin/python" -c '' 2>/dev/null; then
    echo "ci: using the checkout's virtual environment $venv" \
         "(made by an earlier run from $(cat "$venv/$HPCT_VENV_READY"))" >&2
    echo "$venv/bin/python"
    return 0
  fi
  echo "ci: $base is managed by the OS (PEP 668) and no other python3 is on PATH: making the checkout's" \
       "virtual environment $venv from it (later runs reuse it)" >&2
  if [ "$(readlink -f "$base")" = "$(readlink -f /usr/bin/python3)" ] && command -v dpkg >/dev/null 2>&1; then
    hpct_apt_install python3-venv python3-dev || return 1
  fi
  rm -rf "$venv"
  if ! out=$("$base" -m venv "$venv" 2>&1); then
    rm -rf "$venv"
    echo "ci: $base -m venv $venv failed: $(echo "$out" | grep -v '^$' | tail -n 3 | tr '\n' ' ')" >&2
    echo "  fix: install your OS's venv package for $base (Debian: apt-get install python3-venv)," \
         "or set PYTHON=/path/to/a/python3 that pip may install into" >&2
    return 1
  fi
  "$base" -c 'import sys; print(sys.executable, sys.version.split()[0])' >"$venv/$HPCT_VENV_READY"
  echo "$venv/bin/python"
}

# apt-get install the packages of "$@" that are missing (as root, else through sudo).  Without an
# init system the packages' scripts would try to start their daemons (Slurm, munge): policy-rc.d
# says no for the length of the install; the tests start their own.
hpct_apt_install() {
  local p missing=() sudo="" rc_policy="" rc=0
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "ci: ${missing[*]} missing and no apt-get here" >&2
    echo "  fix: install ${missing[*]} (or your OS's equivalents) yourself" >&2
    return 1
  fi
  echo "ci: apt-get install ${missing[*]}" >&2
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    rc_policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$rc_policy" >/dev/null && $sudo chmod +x "$rc_policy"
  fi
  { $sudo apt-get update -qq >&2 &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null; } || rc=$?
  [ -z "$rc_policy" ] || $sudo rm -f "$rc_policy"
  if [ "$rc" != 0 ]; then
    echo "ci: apt-get install ${missing[*]} failed (exit $rc)" >&2
    echo "  fix: install them yourself (as root: apt-get install ${missing[*]}), then run this again" >&2
  fi
  return "$rc"
}

# Print the path of the installed console script $1 (the file pip wrote beside $PYTHON).
# A pyenv shim for a new script appears only after `pyenv rehash`, and a scripts folder
# may be off PATH altogether: rehash, say how to reach it, and let the caller run the
# real file.  -P: ask the installed package, not the checkout this runs in.
hpct_console_script() {
  local name=$1 path on_path
  path=$("$PYTHON" -P -c "from hpct.cliutil import console_script as c; print(c('$name') or '')")
  if [ -z "$path" ]; then
    echo "ci: the installed hpct has no '$name' console script ($PYTHON)" >&2
    echo "  fix: reinstall it: $PYTHON -m hpct.builder wheel --install" >&2
    return 1
  fi
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash >/dev/null 2>&1 || true; fi
  on_path=$(command -v "$name" || true)
  if [ -z "$on_path" ]; then
    echo "ci: note: '$name' is not on PATH; it is $path (add $(dirname "$path") to PATH)" >&2
  elif [ "$on_path" != "$path" ] && [ "$(pyenv which "$name" 2>/dev/null)" != "$path" ]; then
    echo "ci: note: '$name' on PATH is $on_path, not the one just installed ($path)" >&2
  fi
  echo "$path"
}

hpct_torch_newest() {   # the newest torch hpct supports (hpct.requirements), read from this checkout
  PYTHONPATH="$PWD" "$PYTHON" -c "from hpct.requirements import TORCH_NEWEST; print(TORCH_NEWEST)"
}

# The CA bundle of the machine's pip configuration.  `pip config get global.cert` answers "No such
# key" for a value from /etc/pip.conf or /etc/xdg/pip/pip.conf; `pip config list` shows the merged one.
hpct_pip_cert() { "$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^global\.cert='\(.*\)'\$/\1/p" | tail -n 1; }
