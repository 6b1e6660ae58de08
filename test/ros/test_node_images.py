"""Camera images through the node on real rclpy: a Plan goal's `sensor_msgs/Image[]` and the
`planner.image_topic` frame reach the engine as the same embeddings as the pixels straight
through the tower; a bad image or a missing or stale frame aborts the goal with the reason
while the node keeps serving."""

from __future__ import annotations

import json

import numpy as np
import torch
from live import requires_ros, wait_for

from flash_planner.engine.inputs.images import to_patches

pytestmark = requires_ros
PIXELS = np.random.default_rng(12).integers(0, 256, (24, 40, 3), dtype=np.uint8)
TOPIC = "/test_camera/image_raw"


def _image(pixels: np.ndarray, encoding: str, stamp=None):
    from sensor_msgs.msg import Image

    channels = pixels[:, :, ::-1] if encoding == "bgr8" else pixels
    h, w, c = channels.shape
    msg = Image(height=h, width=w, encoding=encoding, step=w * c,
                data=np.ascontiguousarray(channels).tobytes())
    if stamp is not None:
        msg.header.stamp = stamp
    return msg


def test_goal_images_and_the_image_topic_frame_reach_the_engine_as_the_same_embeddings(
        harness, vl_chat_dir, make_engine, embedded):
    from rclpy.duration import Duration
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    engine = make_engine(vl_chat_dir)
    image = to_patches(PIXELS, engine.vision.image_config)
    with torch.inference_mode():
        reference = engine.vision.tower(image.patches, [image.grid])
    h = harness(**{"model.path": str(vl_chat_dir), "model.preset": "",
                   "engine.max_context": 1024, "planner.max_new_tokens": 6,
                   "planner.image_topic": TOPIC, "planner.image_max_age_s": 5.0})
    h.bring_up()
    status, result = h.plan(thinking=False)
    assert not result.success and "no frame received yet on the image topic " \
        f"{TOPIC} (planner.image_topic)" in result.error, result.error
    camera = h.client_node.create_publisher(Image, TOPIC, qos_profile_sensor_data)
    clock = h.client_node.get_clock()

    def publish(stamp):
        before = h.node._camera._frame
        assert wait_for(lambda: camera.get_subscription_count() > 0, 30)
        camera.publish(_image(PIXELS, "rgb8", stamp.to_msg()))
        assert wait_for(lambda: h.node._camera._frame is not before, 30)

    publish(clock.now() - Duration(seconds=30))
    status, result = h.plan(thinking=False)
    assert "s old, the limit is 5.0 s (planner.image_max_age_s)" in result.error, result.error
    publish(clock.now())
    embedded.clear()
    status, result = h.plan(thinking=False, images=[_image(PIXELS, "bgr8")])
    t = result.telemetry
    assert (t.images, t.image_tokens) == (2, 2 * image.tokens), result.error
    assert 0.0 <= t.image_age_ms < 5000.0 and t.vision_ms > 0
    assert embedded and all(torch.equal(e, reference) for e in embedded)
    # a ~/task message gets the topic's frame too
    assert wait_for(lambda: h.task_pub.get_subscription_count() > 0, 30)
    h.task_pub.publish(String(data=json.dumps({"id": "cam", "task": "clear the table"})))
    assert wait_for(lambda: any(p["id"] == "cam" for p in h.plans))
    plan = next(p for p in h.plans if p["id"] == "cam")
    assert plan["telemetry"]["images"] == 1 and plan["telemetry"]["image_age_ms"] >= 0
    # a goal image the node cannot read: refused naming it, and the node keeps serving
    status, result = h.plan(thinking=False, images=[_image(PIXELS, "yuv422")])
    assert result.error.startswith("invalid request: goal.images[0].encoding 'yuv422' is "
                                   "not supported"), result.error
    assert result.telemetry.images == 0
    too_many = [_image(PIXELS, "rgb8")] * 4           # and the topic's frame: five
    status, result = h.plan(thinking=False, images=too_many)
    assert "images: 5 images, the limit is 4 per request" in result.error
    status, result = h.plan(thinking=False)
    assert result.telemetry.images == 1
