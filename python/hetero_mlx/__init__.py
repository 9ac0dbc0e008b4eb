"""hetero_mlx: the decoder seam.

The only Python in hetero. It starts the released mlx-lm OpenAI server, unmodified, and adds
the seam at launch: tokenize exactly as the server will, report the cached prefix, mount a
bridge-written cache into the server's own prompt cache, and dump the server's native caches
as the truth tests compare against. It also exports the decoder's weights for the prefill host.

Subcommands (python -m hetero_mlx ...): serve, export, tiny-llama.
"""

STORE_FORMAT = "hetero-store-v1"
WEIGHTS_FORMAT = "hetero-decoder-weights-v1"
