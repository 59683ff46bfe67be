"""A plugin that fails at import: simulates a plugin whose dependency is missing, so tests can
check that kernelmux quarantines it (or, with KERNELMUX_STRICT=1, raises PluginLoadError)."""

raise ImportError(
    "kernelmux_example_plugin.broken needs 'kernelmux_example_dependency', which is not installed "
    "(simulated by the example plugin)"
)
