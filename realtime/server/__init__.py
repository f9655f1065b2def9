"""The server: the `parley` commands, config, app assembly, launch, drain and the worker supervisor."""
