"""What both generation engines (static and continuous) use to pick tokens
(``sampling``) and turn them into streamed text (``streaming``). Never imports ray."""
