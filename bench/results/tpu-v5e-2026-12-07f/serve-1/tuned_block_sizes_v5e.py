"""Tuned block sizes of JAX's ragged paged attention, measured by flash-autotune
(autotune export --format jax-rpa)."""

TUNED_BLOCK_SIZES = {'TPU v5 lite': {('bfloat16', 'bfloat16', 8, 1, 128, 128, 8192, 32768): (32, 32),
                 ('bfloat16', 'bfloat16', 32, 8, 128, 32, 2048, 8192): (16, 32),
                 ('bfloat16', 'bfloat16', 32, 8, 128, 64, 8192, 8192): (8, 32)},
 'TPU v5': {('bfloat16', 'bfloat16', 8, 1, 128, 128, 8192, 32768): (32, 32),
            ('bfloat16', 'bfloat16', 32, 8, 128, 32, 2048, 8192): (16, 32),
            ('bfloat16', 'bfloat16', 32, 8, 128, 64, 8192, 8192): (8, 32)}}
