"""Peer copies of checkpoint shards: the stream protocol, partner placement, and the
runtime's replication of each save onto partner hosts."""
