"""HTTP plumbing under hypercorn and Starlette: transport limits, framing, Host allow-list."""
