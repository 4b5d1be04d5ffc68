"""kvspec plugin for the chunked_local KV-cache family."""
