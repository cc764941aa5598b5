"""The runner: the device side. Step batches (`step_batch`), the jitted prefill / decode /
speculative / page-copy steps (`model_runner`, with the engine's options resolved for them in
`runner_config`), sampling, and the executable store that
keeps compiled steps across restarts. Pure functions of arrays with static config; it never
sees a request or a string. Above: the engine. Below: the models and the kernels.
"""
