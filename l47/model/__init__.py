"""l47.model — the model files: GGUF access (`gguf_io`), quant codecs (`quants`), the tensor-name table and every
constant of the format (`names`, the one constants module, like gguf-py's), the vocabulary (`vocab`) and the
runtime weights the tail reads (`weights`, output.scale folded in once).

May import: l47.errors, l47.fileio, l47.model.*, l47.dumps (nothing else of l47). Installed as `l47.model`.
Every layer, `dumps/` included, may import `l47.model.names`: it imports nothing of l47.
"""
