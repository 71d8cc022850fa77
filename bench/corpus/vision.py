"""torchvision and timm image models (their definitions, seeded random weights): classifiers
(ResNet, MobileNetV3 with depthwise + squeeze-excite + hardswish, EfficientNet, ShuffleNet,
ConvNeXt, timm's TF-"same"-padded MobileNetV3), a detector with its post-processing (SSDlite:
decode + NMS), segmentation (LRASPP, DeepLabV3), ViT and Swin."""

from __future__ import annotations

from bench.corpus.spec import Spec, image, seeded

TV = ("torchvision",)
TIMM = ("timm",)
BATCH = {"x": {0: "batch"}}


def _tv(name: str, **kw):
    def make():
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kw)
    make.__name__ = name
    return seeded(make)


def _timm(name: str, **kw):
    def make():
        import timm

        return timm.create_model(name, pretrained=False, **kw)
    make.__name__ = name
    return seeded(make)


def _ssdlite():
    def make():
        import torch
        import torchvision

        class Detector(torch.nn.Module):  # list-of-images in, boxes/scores/labels out
            def __init__(self):
                super().__init__()
                self.model = torchvision.models.get_model(
                    "ssdlite320_mobilenet_v3_large", weights=None, weights_backbone=None,
                    num_classes=21, score_thresh=0.3, detections_per_img=50)

            def forward(self, x):
                det = self.model(list(x))[0]
                return det["boxes"], det["scores"], det["labels"]

        return Detector()
    return seeded(make)


def _segment(name: str):
    def make():
        import torch
        import torchvision

        class Segmenter(torch.nn.Module):  # the "out" head of the dict torchvision returns
            def __init__(self):
                super().__init__()
                self.model = torchvision.models.get_model(name, weights=None,
                                                          weights_backbone=None,
                                                          num_classes=21)

            def forward(self, x):
                return self.model(x)["out"]

        return Segmenter()
    make.__name__ = name
    return seeded(make)


def specs() -> list[Spec]:
    def cls(name, source, make, opset=17, exporter="torchscript", size=(224, 224), req=TV):
        dyn = BATCH if exporter == "torchscript" else {}
        return Spec(name, "cnn", source, exporter, [image("x", size)], ["logits"], opset,
                    requires=req + (("onnxscript",) if exporter == "dynamo" else ()),
                    make=make, dynamic=dyn)

    vit = Spec("timm_vit_tiny_op17", "vision-transformer", "timm vit_tiny_patch16_224",
               "torchscript", [image()], ["logits"], 17, requires=TIMM,
               make=_timm("vit_tiny_patch16_224"), dynamic=BATCH)
    return [
        cls("tv_resnet50_op17", "torchvision resnet50", _tv("resnet50")),
        cls("tv_resnet18_dynamo_op18", "torchvision resnet18", _tv("resnet18"), 18, "dynamo"),
        cls("tv_mobilenet_v3_small_op13", "torchvision mobilenet_v3_small",
            _tv("mobilenet_v3_small"), 13),
        cls("tv_mobilenet_v3_large_dynamo_op18", "torchvision mobilenet_v3_large",
            _tv("mobilenet_v3_large"), 18, "dynamo"),
        cls("tv_efficientnet_b0_op17", "torchvision efficientnet_b0 (SiLU, SE)",
            _tv("efficientnet_b0")),
        cls("tv_shufflenet_v2_op13", "torchvision shufflenet_v2_x1_0 (channel shuffle)",
            _tv("shufflenet_v2_x1_0"), 13),
        cls("timm_tf_mobilenetv3_op13", "timm tf_mobilenetv3_large_100 (TF 'same' padding)",
            _timm("tf_mobilenetv3_large_100"), 13, req=TIMM),
        cls("timm_tf_efficientnet_b0_op17", "timm tf_efficientnet_b0 (TF 'same' padding)",
            _timm("tf_efficientnet_b0"), 17, req=TIMM),
        cls("timm_convnext_atto_op17", "timm convnext_atto (LayerNorm2d, 7x7 depthwise)",
            _timm("convnext_atto"), 17, req=TIMM),
        cls("timm_mobilevit_xxs_op17", "timm mobilevit_xxs (conv + attention)",
            _timm("mobilevit_xxs"), 17, size=(256, 256), req=TIMM),
        Spec("tv_ssdlite320_op17", "detector", "torchvision ssdlite320_mobilenet_v3_large "
             "(anchors, box decode, batched NMS)", "torchscript", [image("x", (320, 320))],
             ["boxes", "scores", "labels"], 17, requires=TV, make=_ssdlite()),
        Spec("tv_lraspp_op17", "segmentation", "torchvision lraspp_mobilenet_v3_large",
             "torchscript", [image("x", (320, 320))], ["out"], 17, requires=TV,
             make=_segment("lraspp_mobilenet_v3_large"), dynamic=BATCH),
        Spec("tv_deeplabv3_mbv3_op13", "segmentation",
             "torchvision deeplabv3_mobilenet_v3_large (ASPP, dilated convs)", "torchscript",
             [image("x", (256, 256))], ["out"], 13, requires=TV,
             make=_segment("deeplabv3_mobilenet_v3_large"), dynamic=BATCH),
        vit,
        Spec("timm_vit_tiny_dynamo_op18", "vision-transformer", "timm vit_tiny_patch16_224",
             "dynamo", [image()], ["logits"], 18, requires=TIMM + ("onnxscript",),
             make=_timm("vit_tiny_patch16_224")),
        Spec("timm_swin_tiny_op17", "vision-transformer", "timm swin_tiny_patch4_window7_224 "
             "(embed 48, shifted windows)", "torchscript", [image()], ["logits"], 17,
             requires=TIMM, make=_timm("swin_tiny_patch4_window7_224", embed_dim=48,
                                       num_heads=(2, 4, 8, 16)), dynamic=BATCH),
        Spec("tv_swin_t_op17", "vision-transformer", "torchvision swin_t", "torchscript",
             [image()], ["logits"], 17, requires=TV, make=_tv("swin_t"), dynamic=BATCH),
    ]
