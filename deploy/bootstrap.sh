# Sourced by quickstart.sh and test.sh: Python 3.11+, the virtual environment at .venv, and the
# pinned dependencies from requirements/*.lock (hash-checked, so every install is the same;
# installed with uv, itself pinned in requirements/uv.lock, or pip where uv cannot be had).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo "$@"
    else echo "error: need root (or sudo) to run: $*" >&2; return 1
    fi
}

apt_install() {
    local missing=()
    for package in "$@"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: please install these packages: ${missing[*]}" >&2
        return 1
    fi
    echo "installing system packages: ${missing[*]}" >&2
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

pick_python() {
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    echo "error: Palisade needs Python 3.11 or newer" >&2
    return 1
}

ensure_venv() {
    local lock="$ROOT/requirements/$1.lock"
    if [ ! -x "$VENV/bin/python" ]; then
        local python
        python="$(pick_python)"
        if ! "$python" -m venv "$VENV" >/dev/null 2>&1; then
            rm -rf "$VENV"
            local version
            version="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
            apt_install "python${version}-venv"
            "$python" -m venv "$VENV"
        fi
    fi
    local stamp="$VENV/.installed-$(basename "$lock")"
    local digest
    digest="$(sha256sum "$lock" | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]; then
        echo "installing pinned Python dependencies from ${lock#"$ROOT"/}" >&2
        install_locked "$lock"
        echo "$digest" >"$stamp"
    fi
}

install_locked() {
    # uv installs a lock about ten times faster than pip (10 s against 100 s here, most of pip's in its
    # own Python): uv itself comes hash-pinned from requirements/uv.lock, and pip installs the lock
    # when uv cannot be had or fails.
    if "$VENV/bin/python" -m pip install -q --disable-pip-version-check --require-hashes \
        -r "$ROOT/requirements/uv.lock" >/dev/null 2>&1 &&
        "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --require-hashes -r "$1"; then
        return 0
    fi
    echo "uv unavailable: installing with pip" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --require-hashes -r "$1"
}

link_debian_nftables() {
    # libnftables' Python module is pure ctypes and ships only as a Debian package; link it into the
    # venv rather than exposing all of Debian's dist-packages.
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    ln -sfn /usr/lib/python3/dist-packages/nftables "$site/nftables"
}
