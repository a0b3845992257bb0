"""The engine's configuration, one typed class per concern (a module each), composed by
`engine.py:EngineConfig`; each field marked with a `Flag` is a setting of `loraswap serve`."""
