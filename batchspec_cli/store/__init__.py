"""What reaches disk: the file rules, the output files and checkpoint parts, the work directory, the merge and the
length buckets."""
