"""Length buckets for EXSPEC: prompts grouped by token length, one Parquet shard per bucket."""

from buckets.bucketing import (
    MANIFEST_NAME,
    PROMPT_IDS_COLUMN,
    ROW_COLUMN,
    Bucket,
    BucketError,
    Manifest,
    auto_max_width,
    bucket_chunk,
    build_buckets,
    is_bucket_dir,
    iter_bucket_rows,
    open_buckets,
    plan_buckets,
    read_all_rows,
    settings_hash,
    write_buckets,
)

__all__ = [
    "MANIFEST_NAME",
    "PROMPT_IDS_COLUMN",
    "ROW_COLUMN",
    "Bucket",
    "BucketError",
    "Manifest",
    "auto_max_width",
    "bucket_chunk",
    "build_buckets",
    "is_bucket_dir",
    "iter_bucket_rows",
    "open_buckets",
    "plan_buckets",
    "read_all_rows",
    "settings_hash",
    "write_buckets",
]
