"""Parallelism: tensor-parallel meshes and parameter placement (`sharding`), and several
processes replaying one leader's runner calls (`multihost`). Used by the runner; uses the
models' layouts and the kernels."""
