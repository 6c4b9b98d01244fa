"""Tuned block sizes of JAX's ragged paged attention, measured by flash-autotune
(autotune export --format jax-rpa)."""

TUNED_BLOCK_SIZES = {'TPU v5 lite': {('bfloat16', 'bfloat16', 8, 1, 128, 16, 512, 2048): (64, 32),
                 ('bfloat16', 'bfloat16', 32, 8, 128, 16, 512, 2048): (32, 32)},
 'TPU v5': {('bfloat16', 'bfloat16', 8, 1, 128, 16, 512, 2048): (64, 32),
            ('bfloat16', 'bfloat16', 32, 8, 128, 16, 512, 2048): (32, 32)}}
