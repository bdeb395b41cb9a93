"""One `generate` job: what it decides when it opens (plan), its run loop (generation), what is already done (done),
what reaches disk (writer), where its engine is built (assembly)."""
