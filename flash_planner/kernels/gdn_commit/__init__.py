"""Commit: replay the accepted rows of a verify into the GDN state and rebuild the conv window."""
