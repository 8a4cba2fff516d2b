"""Domain types of the vector store, shared by every module (the servicer converts them to protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

__all__ = [
    "AttributeValue",
    "Attributes",
    "FileObject",
    "ChunkingSpec",
    "AUTO_CHUNKING",
    "ExpiresAfter",
    "FileCounts",
    "VectorStore",
    "VectorStoreFile",
    "FileBatch",
    "PageRequest",
    "Page",
    "SearchHit",
    "FileStatus",
    "FILE_STATUSES",
]

AttributeValue = str | float | bool
Attributes = dict[str, AttributeValue]
FileStatus = Literal["in_progress", "completed", "failed", "cancelled"]
FILE_STATUSES: tuple[str, ...] = ("in_progress", "completed", "failed", "cancelled")

T = TypeVar("T")


@dataclass(frozen=True)
class FileObject:
    """An uploaded file (OpenAI's ``file`` object)."""

    id: str
    size_bytes: int
    created_at: int
    filename: str
    purpose: str
    media_type: str


@dataclass(frozen=True)
class ChunkingSpec:
    """Chunk size and overlap in tokens; ``auto`` is 800/400 (OpenAI's default)."""

    max_chunk_size_tokens: int = 800
    chunk_overlap_tokens: int = 400


AUTO_CHUNKING = ChunkingSpec()


@dataclass(frozen=True)
class ExpiresAfter:
    """Expiry policy: ``days`` after the store was last active."""

    days: int
    anchor: str = "last_active_at"


@dataclass(frozen=True)
class FileCounts:
    in_progress: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def total(self) -> int:
        return self.in_progress + self.completed + self.failed + self.cancelled


@dataclass(frozen=True)
class VectorStore:
    id: str
    created_at: int
    name: str
    usage_bytes: int
    file_counts: FileCounts
    status: Literal["in_progress", "completed", "expired"]
    expires_after: ExpiresAfter | None
    expires_at: int | None
    last_active_at: int
    metadata: dict[str, str]
    embedding_model: str
    dimensions: int


@dataclass(frozen=True)
class VectorStoreFile:
    id: str
    created_at: int
    vector_store_id: str
    usage_bytes: int
    status: FileStatus
    last_error: tuple[str, str] | None
    """(code, message) when failed."""
    chunking: ChunkingSpec
    attributes: Attributes
    chunks_done: int
    chunks_total: int


@dataclass(frozen=True)
class FileBatch:
    id: str
    created_at: int
    vector_store_id: str
    status: FileStatus
    file_counts: FileCounts


@dataclass(frozen=True)
class PageRequest:
    """OpenAI cursor paging; validated by ``store.check_page``."""

    limit: int = 20
    order: Literal["asc", "desc"] = "desc"
    after: str = ""
    before: str = ""


@dataclass(frozen=True)
class Page(Generic[T]):
    data: list[T]
    has_more: bool

    @property
    def first_id(self) -> str:
        return getattr(self.data[0], "id", "") if self.data else ""

    @property
    def last_id(self) -> str:
        return getattr(self.data[-1], "id", "") if self.data else ""


@dataclass(frozen=True)
class SearchHit:
    file_id: str
    filename: str
    score: float
    attributes: Attributes
    text: str
    chunk_id: int = 0
    extra: dict[str, object] = field(default_factory=dict)
