"""Attention kernels for jaxserve: Pallas kernels and their plain-jnp references.

Nothing here knows about jaxserve: functions take arrays and block sizes.
"""
