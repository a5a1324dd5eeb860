"""Devices and processes: the mesh's shape from a config, meshes and sharding rules, the process
launcher, and the watchdog that ends a stalled multi-process job. Imports only core."""
