"""Cluster plumbing: what accelerators a node has, and how it joins a Ray cluster.

- `cluster.detect`  — read NVIDIA / AMD / CPU inventory from the vendor tools (pure parsers + one subprocess seam).
- `cluster.stacks`  — which engine stack (vLLM build) suits a device: a data table, not a chain of ifs.
- `cluster.tags`    — the Ray resource tags a node advertises (`accelerator:cuda`, `accelerator_model:H100`, ...).
- `cluster.visibility` — device-visibility environment (CUDA_VISIBLE_DEVICES, HIP/ROCR_VISIBLE_DEVICES).
- `cluster.auth`    — Ray token authentication: the token file, where nodes and drivers find it, the probe.
- `cluster.node`    — the `ray start` command line and environment for a node, and running it.
- `cluster.local`   — multi-node Ray clusters on one machine, for tests and demos (also through `node start`).
- `cluster.cli`     — the `nightshift node` sub-commands.

Nothing here imports Ray at module import time; `nightshift --help` stays instant.
"""
