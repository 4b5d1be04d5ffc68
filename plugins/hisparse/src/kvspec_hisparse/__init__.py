"""kvspec plugin for the hisparse KV-cache family."""
