"""kvspec plugin for the mla KV-cache family."""
