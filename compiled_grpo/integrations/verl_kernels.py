"""Importing this module runs verl's fused-kernel path on compiled_grpo in this process (`verl.install()`), so
that verl can do it in each of its workers, with
`actor_rollout_ref.model.external_lib=compiled_grpo.integrations.verl_kernels` or
`VERL_USE_EXTERNAL_MODULES=compiled_grpo.integrations.verl_kernels`."""

from .verl import install

uninstall = install()
