# Sourced by the scripts: picks the interpreter and makes the virtualenv.
# PYTHON overrides the choice; otherwise python3.12, then python3.13 (Django 6 needs
# >= 3.12), on PATH or under pyenv, else python3 (>= 3.11, which gets Django 5.2).
find_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    for v in 3.12 3.13; do
        if command -v "python$v" >/dev/null 2>&1 && "python$v" -c '' 2>/dev/null; then
            echo "python$v"; return
        fi
        if command -v pyenv >/dev/null 2>&1; then
            for p in "$(pyenv root)"/versions/"$v".*/bin/python"$v"; do
                if [ -x "$p" ]; then echo "$p"; return; fi
            done
        fi
    done
    echo python3
}

# make_venv DIR [pip install args...]: create DIR if missing, install the project into it.
make_venv() {
    local dir=$1; shift
    if [ ! -x "$dir/bin/python" ]; then
        "$(find_python)" -m venv "$dir"
        "$dir/bin/python" -m pip install --quiet --upgrade "pip>=25.1"
    fi
    "$dir/bin/python" -m pip install --quiet -e . "$@"
}
