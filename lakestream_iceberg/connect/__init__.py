"""How a stream reaches its catalog and object store: loading catalogs with clear configuration errors and bounded
retries (diagnose), one meaning for a setting in a config file, a variable or an argument (catalog_settings), keeping
credentials out of messages, reprs and pickles (secrets), listing storage (storage), and the fixes pyiceberg 0.12's
REST client needs (rest_sigv4, rest_timeout)."""
