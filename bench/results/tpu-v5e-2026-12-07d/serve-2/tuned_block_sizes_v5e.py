"""Tuned block sizes of JAX's ragged paged attention, measured by flash-autotune
(autotune export --format jax-rpa)."""

TUNED_BLOCK_SIZES = {'TPU v5 lite': {('bfloat16', 'bfloat16', 32, 4, 128, 16, 512, 2048): (128, 4),
                 ('bfloat16', 'bfloat16', 32, 8, 128, 16, 512, 2048): (32, 16)},
 'TPU v5': {('bfloat16', 'bfloat16', 32, 4, 128, 16, 512, 2048): (128, 4),
            ('bfloat16', 'bfloat16', 32, 8, 128, 16, 512, 2048): (32, 16)}}
