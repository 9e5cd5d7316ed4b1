"""The import graph: no circle anywhere in canopy/ (function-level and type-checking imports counted), on top of
the layer contract `make lint` checks (pyproject.toml)."""

import grimp


def import_circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            for other in imported:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph.find_modules_directly_imported_by(other)))))
                    break
                if other in on_stack:
                    low[module] = min(low[module], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        other = stack.pop()
                        on_stack.discard(other)
                        component.append(other)
                        if other == module:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_a_circle():
    class Graph:
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, module):
            return self.edges[module]

    assert import_circles(Graph()) == [["a", "b", "c"]]


def test_no_module_of_canopy_imports_itself_through_a_chain():
    graph = grimp.build_graph("canopy", exclude_type_checking_imports=False, cache_dir=None)
    assert "canopy.step" in graph.modules  # this tree's canopy
    assert import_circles(graph) == []
