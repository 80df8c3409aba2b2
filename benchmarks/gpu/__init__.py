"""The GPU session and validation kit: ``check`` (the kit), ``session`` (one prepared command for a
lent GPU), ``tables`` (the committed GPU tables as rows); the other modules are their parts."""
