"""The control room: wire schema and store keys, the engine's update session, and the
trainer's control clients.  Imports no web framework."""
