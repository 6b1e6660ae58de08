"""The planner's chat prompt: skills and plan format in the system message, the task after.

Kept short on purpose: every prompt token is prefilled before the first plan token.
"""

from __future__ import annotations

import json

from .grounding import scene_entries
from .skills import SkillCatalog

SYSTEM = (
    "Plan the robot's task with these skills:\n{skills}\n"
    'Reply with JSON only: {{"plan": [{{"skill": NAME, "args": {{ARG: VALUE}}}}, ...]}}'
)
# The refusal shape (docs/cli.md, "Refusals"). Presets of models that were never taught it leave
# it out (`refusal_hint: false`); the demo was trained on prompts with and without it.
REPLAN_ASK = "Plan the remaining steps."
REFUSAL_HINT = ', or {"refusal": REASON} if these skills cannot do the task'
# The recovery forms (plan_tree.py), for planners with `recovery` on (a model taught them, or
# one that follows a format it is shown); the grammar then admits them too.
RECOVERY_HINT = ('\nWhere the task asks for it, a step may instead be {"retry": N, "plan": '
                 '[STEPS]} (tried up to N times) or {"fallback": [[STEPS], [STEPS]]} '
                 '(alternatives tried in order until one succeeds)')


def system_prompt(catalog: SkillCatalog, refusal_hint: bool = False,
                  recovery: bool = False) -> str:
    lines = "\n".join(f"- {signature}: {s.description}"
                      for s, signature in zip(catalog.skills, catalog.signatures()))
    return (SYSTEM.format(skills=lines) + (REFUSAL_HINT if refusal_hint else "")
            + (RECOVERY_HINT if recovery else ""))


def user_prompt(task: str, context: str = "", scene=(), progress: str = "",
                places=()) -> str:
    """The task, the scene's text, its listed names (without their short forms), the places
    a plan may send the robot to (the location table's names, where a skill takes one) and,
    when replanning, the progress section."""
    text = f"Task: {task.strip()}"
    if context.strip():
        text += f"\nScene: {context.strip()}"
    if scene:
        text += "\nObjects: " + "; ".join(entry[0] for entry in scene_entries(scene))
    if places:
        text += "\nPlaces: " + "; ".join(places)
    if progress.strip():
        text += f"\n{progress.strip()}"
    return text


def progress_section(done: list[dict], failed: dict, reason: str) -> str:
    """The replan section (docs/ros.md, "Replanning"): the steps done, the failed step with
    its reason, and what is asked; a step is its skill and its arguments as JSON.

        Done: navigate_to {"target": "kitchen"}
        Failed: pick {"object": "red cup"} (aborted: /manipulate: the gripper slipped)
        Plan the remaining steps.
    """
    def line(step: dict) -> str:
        return f"{step['skill']} {json.dumps(step.get('args', {}), sort_keys=True)}"

    reason = " ".join(reason.split())
    return (f"Done: {'; '.join(line(s) for s in done) or 'nothing'}\n"
            f"Failed: {line(failed)} ({reason})\n"
            f"{REPLAN_ASK}")


def build_messages(catalog: SkillCatalog, task: str, context: str = "",
                   refusal_hint: bool = False, scene=(), images: int = 0,
                   progress: str = "", recovery: bool = False) -> list[dict]:
    """Chat messages for the tokenizer's template (thinking on/off is the template's flag);
    `images` image parts open the user's message, before the task, so that the system
    prompt stays the fixed prefix."""
    text = user_prompt(task, context, scene, progress, catalog.places)
    user = text if not images else (
        [{"type": "image"}] * images + [{"type": "text", "text": text}])
    return [{"role": "system", "content": system_prompt(catalog, refusal_hint, recovery)},
            {"role": "user", "content": user}]
