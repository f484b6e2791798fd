"""Serving: `raytrain serve` on Ray Serve (source, app, run) and the HTTP launch check (check)."""
