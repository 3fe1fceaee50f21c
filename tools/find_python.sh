#!/usr/bin/env sh
# Print the path of a Python >= 3.12, preferring 3.12 (the tested version):
# python3.12 on PATH, then pyenv's 3.12.x, then newer ones on PATH, then newer pyenv versions.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for minor in 12 13 14 15; do
    p=$(command -v "python3.$minor" 2>/dev/null) && ok "$p" && { echo "$p"; exit 0; }
    for d in $(ls -d "$root"/versions/3.$minor.* 2>/dev/null | sort -rV); do
        [ -x "$d/bin/python3.$minor" ] && ok "$d/bin/python3.$minor" && { echo "$d/bin/python3.$minor"; exit 0; }
    done
done
p=$(command -v python3 2>/dev/null) && ok "$p" && { echo "$p"; exit 0; }
echo "synkhronos needs Python >= 3.12 and none was found on PATH or under pyenv." >&2
echo "Install one (e.g. 'pyenv install 3.12' or your system's python3.12 package) and rerun make." >&2
exit 1
