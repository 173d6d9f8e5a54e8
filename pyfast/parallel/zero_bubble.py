"""Zero-bubble's split backward (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): I, the
stage input's gradient now, so the previous stage can go on; W, the parameters' gradients later,
to fill the bubbles. Used by pyfast.parallel.pipeline's zb-h1 schedule (and for large Linear
stages under the other schedules, where the in-place dW GEMM pays)."""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def input_grad(out, grad, x, params, want_x: bool = True):
    """Zero-bubble's I: the stage input's gradient now, and a plan for W. The plan lists the
    autograd nodes where a parameter-only branch joins the input's path (Linear's AddmmBackward)
    with the gradient flowing into each: the engine hands those back as extra `inputs` and never
    runs the parameter edges, so W re-enters there and no work is done twice. With want_x False
    (stage 0) x's own gradient is not computed either. Returns (plan, input gradient), or None
    when a parameter hangs below two such nodes (tied weights: W from each would count the
    other's share again) or a joining node has several outputs."""
    x_node, acc = get_gradient_edge(x).node, {get_gradient_edge(p).node: p for p in params}
    order, seen, stack = [], {out.grad_fn}, [(out.grad_fn, iter(out.grad_fn.next_functions))]
    while stack:  # children before parents, without recursion (stages can be deep)
        node, it = stack[-1]
        for child, _ in it:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:
            stack.pop()
            order.append(node)
    to_x, below, plan, owners = {}, {}, [], set()
    for node in order:
        kids = [c for c, _ in node.next_functions if c is not None]
        to_x[node] = node is x_node or any(to_x[c] for c in kids)
        if not to_x[node]:
            below[node] = [acc[node]] if node in acc else [p for c in kids for p in below[c]]
        elif (ps := [p for c in kids if not to_x[c] for p in below[c]]):
            if len(getattr(node, "_input_metadata", ())) != 1 or owners & {id(p) for p in ps}:
                return None
            owners |= {id(p) for p in ps}
            plan.append([node, None, ps])
    inputs = ([x] if want_x else []) + [GradientEdge(node, 0) for node, _, _ in plan]
    if not inputs:
        return plan, None
    grads = torch.autograd.grad(out, inputs, grad, retain_graph=True, allow_unused=True)
    for step, g in zip(plan, grads[int(want_x):]):
        step[1] = g
    return plan, grads[0] if want_x else None


def weight_grad(plan):
    """Zero-bubble's W: from each planned node, back-propagate to its parameters only."""
    for node, g, params in plan:
        if g is not None and not _linear_weight_grad(node, g, params):
            torch.autograd.backward([GradientEdge(node, 0)], [g], inputs=params)


def _linear_weight_grad(node, g, params) -> bool:
    """nn.Linear's W as one in-place GEMM, weight.grad += g^T x (addmm_ with beta 1), instead of
    autograd's separate dW tensor and the pass that adds it to .grad. The weight gradients of
    4 x Linear(1024) over 8 micro-batches of 32 rows took 31 ms instead of 39 ms (AMD EPYC,
    one thread): at 32 rows they are bound by the 4 MB gradient, so a pass less shows. Only the
    exact pattern addmm(bias, x, weight.t()) / mm(x, weight.t()) of F.linear qualifies, and only
    without gradient hooks on the parameters; anything else returns False (autograd does it)."""
    name = node.name()
    if name not in ("AddmmBackward0", "MmBackward0") or g.dim() != 2:
        return False
    kids = [c for c, _ in node.next_functions]
    w_node = kids[-1]
    if w_node is None or w_node.name() != "TBackward0":
        return False
    by_node = {get_gradient_edge(p).node: p for p in params}
    w = by_node.get(w_node.next_functions[0][0])
    b = by_node.get(kids[0]) if name == "AddmmBackward0" else None
    if w is None or len(params) != 1 + (b is not None) or any(
            p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
        return False
    if name == "AddmmBackward0":
        if node._saved_alpha != 1 or node._saved_beta != 1 or b is None or b.dim() != 1:
            return False
        x = node._saved_mat1
    else:
        x = node._saved_self
    if x.dim() != 2 or w.shape != (g.shape[1], x.shape[1]) or x.dtype != w.dtype:
        return False
    with torch.no_grad():
        w.grad = torch.mm(g.t(), x) if w.grad is None else w.grad.addmm_(g.t(), x)
        if b is not None:
            b.grad = g.sum(0) if b.grad is None else b.grad.add_(g.sum(0))
    return True
