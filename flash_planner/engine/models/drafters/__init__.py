"""The drafters: DFlash (and DFlash2's convs and selector) and the MTP head."""
