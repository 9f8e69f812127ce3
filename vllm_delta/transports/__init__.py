"""How encoded flushes reach the engines: one module per transport, each a `base.Transport` created by
name (`base.create`), holding its sender half and its engine-receive half (docs/architecture.md)."""
