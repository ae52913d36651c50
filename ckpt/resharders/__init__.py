"""Layouts, sharding rules and reshard plans (see the resharding issue)."""
