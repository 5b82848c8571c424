"""The MetaQA movie knowledge graph (metaqa/kb.txt), loaded once per process and indexed both ways.

Lines are `movie|relation|object`. Entities are interned to ints, and each (entity, relation) pair
maps to a tuple of neighbour ids, forwards (movie -> object) and backwards (object -> movie):
about 43k entities and 129k triples, some tens of MB in total.

Relation names as the tools show them: the KB's own name follows the edge forwards (from a movie,
`directed_by` gives its directors); the name with `_inv` follows it backwards (from a person,
`directed_by_inv` gives the movies they directed), after AgentBench's `_inv` relations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

INVERSE = "_inv"

# The entity type at the far end of each relation (MetaQA's question-type words).
RANGE = {
    "directed_by": "director",
    "written_by": "writer",
    "starred_actors": "actor",
    "release_year": "year",
    "in_language": "language",
    "has_genre": "genre",
    "has_tags": "tag",
    "has_imdb_rating": "imdbrating",
    "has_imdb_votes": "imdbvotes",
}
MOVIE = "movie"
# Relations whose values are numbers: the attributes that get_attributes/argmax/argmin work on.
NUMERIC = ("release_year", "has_imdb_rating", "has_imdb_votes")


def range_type(relation: str) -> str:
    """The type of what `relation` leads to: the object's type forwards, a movie backwards."""
    return MOVIE if relation.endswith(INVERSE) else RANGE[relation]


@dataclass(frozen=True)
class Graph:
    names: tuple[str, ...]
    ids: dict[str, int]
    edges: dict[tuple[int, str], tuple[int, ...]]
    relations_of: dict[int, tuple[str, ...]]

    def entity(self, name: str) -> int | None:
        return self.ids.get(name)

    def relations(self, entities: Iterable[int]) -> list[str]:
        found: set[str] = set()
        for entity in entities:
            found.update(self.relations_of.get(entity, ()))
        return sorted(found)

    def neighbors(self, entities: Iterable[int], relation: str) -> set[int]:
        found: set[int] = set()
        for entity in entities:
            found.update(self.edges.get((entity, relation), ()))
        return found

    def attributes(self, entities: Iterable[int]) -> list[str]:
        """The numeric relations some of the entities have."""
        return [r for r in self.relations(entities) if r in NUMERIC]

    def value(self, entity: int, attribute: str) -> float | None:
        """The entity's numeric value of the attribute (the largest when it has several), None if none parses."""
        values = []
        for target in self.edges.get((entity, attribute), ()):
            try:
                values.append(float(self.names[target].replace(",", "")))
            except ValueError:
                continue
        return max(values) if values else None


def parse(lines: Iterable[str]) -> Graph:
    ids: dict[str, int] = {}
    names: list[str] = []
    edges: dict[tuple[int, str], list[int]] = defaultdict(list)

    def intern(name: str) -> int:
        if name not in ids:
            ids[name] = len(names)
            names.append(name)
        return ids[name]

    for line in lines:
        parts = line.rstrip("\n").split("|")
        if len(parts) != 3:
            continue
        subject, relation, obj = intern(parts[0]), parts[1], intern(parts[2])
        edges[(subject, relation)].append(obj)
        edges[(obj, relation + INVERSE)].append(subject)
    relations_of: dict[int, set[str]] = defaultdict(set)
    for entity, relation in edges:
        relations_of[entity].add(relation)
    return Graph(
        names=tuple(names),
        ids=ids,
        edges={key: tuple(dict.fromkeys(value)) for key, value in edges.items()},
        relations_of={entity: tuple(sorted(rels)) for entity, rels in relations_of.items()},
    )


@cache
def load(path: Path) -> Graph:
    """The graph of a kb.txt; read once per process (about a second), then shared by every session."""
    with path.open(encoding="utf-8") as handle:
        return parse(handle)
