//! Image preprocessing as transformers' CLIP and SigLIP image processors do it (their PIL
//! backend): decode, convert to RGB, resize (shortest edge or exact size, with the config's PIL
//! resample filter, in 8 bits per channel as Pillow does it: [`crate::resample`]), center crop (zero-padding an image
//! smaller than the crop), rescale (`× 1/255` in f64, stored as f32) and normalize
//! (`(x − mean) / std` in f32). Output is channel-first `[3, height, width]`.
//!
//! The settings come from the model's `preprocessor_config.json`; keys it leaves out take the
//! defaults of the processor class its `image_processor_type` names, as transformers does.

use std::io::Cursor;
use std::path::Path;

use crate::{ConfigObject, LoadError, MediaError};

/// The largest image, in pixels, a processor decodes unless its config says otherwise: a
/// bound on the memory one hostile image can take (the gateway's header check comes first).
pub const DEFAULT_MAX_PIXELS: u64 = 8192 * 8192;

/// A PIL resample filter, by the number transformers stores in `resample`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resample {
    /// 0.
    Nearest,
    /// 1.
    Lanczos,
    /// 2.
    Bilinear,
    /// 3.
    Bicubic,
    /// 4.
    Box,
    /// 5.
    Hamming,
}

impl Resample {
    fn from_pil(code: usize) -> Option<Resample> {
        Some(match code {
            0 => Resample::Nearest,
            1 => Resample::Lanczos,
            2 => Resample::Bilinear,
            3 => Resample::Bicubic,
            4 => Resample::Box,
            5 => Resample::Hamming,
            _ => return None,
        })
    }
}

/// How the resize step sizes its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeTo {
    /// The shorter side becomes this many pixels, the longer keeps the aspect ratio (rounded
    /// down, as transformers' `get_resize_output_image_size`).
    ShortestEdge(u32),
    /// Exactly this size.
    Exact {
        /// Output height.
        height: u32,
        /// Output width.
        width: u32,
    },
}

/// A `preprocessor_config.json`'s image settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessor {
    /// `do_resize` and `size`.
    pub resize: Option<ResizeTo>,
    /// `resample`.
    pub resample: Resample,
    /// `do_center_crop` and `crop_size` (height, width).
    pub center_crop: Option<(u32, u32)>,
    /// `do_rescale` and `rescale_factor`.
    pub rescale: Option<f64>,
    /// `do_normalize`, `image_mean` and `image_std`.
    pub normalize: Option<([f32; 3], [f32; 3])>,
    /// The largest decoded image accepted (`max_pixels`).
    pub max_pixels: u64,
}

/// Preprocessed pixels: channel-first `[3, height, width]` f32.
#[derive(Debug, Clone, PartialEq)]
pub struct PixelValues {
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// `3 × height × width` values, channel-major.
    pub data: Vec<f32>,
}

const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];
const STANDARD_MEAN: [f32; 3] = [0.5, 0.5, 0.5];
const STANDARD_STD: [f32; 3] = [0.5, 0.5, 0.5];

impl ImageProcessor {
    /// CLIP's defaults: shortest edge 224, bicubic, center crop 224, OpenAI mean and std.
    pub fn clip() -> ImageProcessor {
        ImageProcessor {
            resize: Some(ResizeTo::ShortestEdge(224)),
            resample: Resample::Bicubic,
            center_crop: Some((224, 224)),
            rescale: Some(1.0 / 255.0),
            normalize: Some((CLIP_MEAN, CLIP_STD)),
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }

    /// SigLIP's defaults: 224 × 224, bicubic, no crop, mean and std 0.5.
    pub fn siglip() -> ImageProcessor {
        ImageProcessor {
            resize: Some(ResizeTo::Exact {
                height: 224,
                width: 224,
            }),
            resample: Resample::Bicubic,
            center_crop: None,
            rescale: Some(1.0 / 255.0),
            normalize: Some((STANDARD_MEAN, STANDARD_STD)),
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }

    /// Reads `preprocessor_config.json`.
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming the file and key: an unreadable file, an unknown processor type,
    /// a malformed value.
    pub fn from_file(path: &Path) -> Result<ImageProcessor, LoadError> {
        let value = crate::read_json(path)?;
        ImageProcessor::from_json(path, &value)
    }

    /// Reads a processor config already parsed from `path` (named in errors).
    ///
    /// # Errors
    ///
    /// As [`ImageProcessor::from_file`].
    pub fn from_json(path: &Path, value: &serde_json::Value) -> Result<ImageProcessor, LoadError> {
        let config = ConfigObject::new(path, value);
        let kind = config.str_or("image_processor_type", "CLIPImageProcessor")?;
        let defaults = if kind.starts_with("CLIPImageProcessor") || kind.starts_with("LlavaImageProcessor") {
            ImageProcessor::clip()
        } else if kind.starts_with("SiglipImageProcessor") {
            ImageProcessor::siglip()
        } else {
            return Err(config.error(
                "image_processor_type",
                format!("`{kind}` is not supported (CLIPImageProcessor and SiglipImageProcessor are)"),
            ));
        };
        let resize = if config.bool_or("do_resize", defaults.resize.is_some())? {
            match config.object("size") {
                None => Some(defaults.resize.ok_or_else(|| config.error("size", "missing"))?),
                Some(size) => {
                    if size.get("shortest_edge").is_some() {
                        if size.get("longest_edge").is_some() {
                            return Err(size.error("longest_edge", "is not supported"));
                        }
                        Some(ResizeTo::ShortestEdge(positive(&size, "shortest_edge")?))
                    } else {
                        Some(ResizeTo::Exact {
                            height: positive(&size, "height")?,
                            width: positive(&size, "width")?,
                        })
                    }
                }
            }
        } else {
            None
        };
        let resample_code = config.usize_or("resample", Some(pil_code(defaults.resample)))?;
        let resample = Resample::from_pil(resample_code)
            .ok_or_else(|| config.error("resample", format!("{resample_code} is not a PIL filter (0 to 5)")))?;
        let center_crop = if config.bool_or("do_center_crop", defaults.center_crop.is_some())? {
            match config.object("crop_size") {
                Some(crop) => Some((positive(&crop, "height")?, positive(&crop, "width")?)),
                None => Some(defaults.center_crop.unwrap_or((224, 224))),
            }
        } else {
            None
        };
        let rescale = if config.bool_or("do_rescale", true)? {
            Some(config.f64_or("rescale_factor", 1.0 / 255.0)?)
        } else {
            None
        };
        let normalize = if config.bool_or("do_normalize", true)? {
            let (mean, std) = defaults.normalize.unwrap_or((CLIP_MEAN, CLIP_STD));
            let std = triple(&config, "image_std", std)?;
            if std.contains(&0.0) {
                return Err(config.error("image_std", "a standard deviation of 0"));
            }
            Some((triple(&config, "image_mean", mean)?, std))
        } else {
            None
        };
        let max_pixels = config.usize_or("max_pixels", Some(DEFAULT_MAX_PIXELS as usize))? as u64;
        if config.bool_or("do_convert_rgb", true)? {
            Ok(ImageProcessor {
                resize,
                resample,
                center_crop,
                rescale,
                normalize,
                max_pixels,
            })
        } else {
            Err(config.error("do_convert_rgb", "false is not supported (every image becomes RGB)"))
        }
    }

    /// The output size for an image of `height × width`.
    pub fn output_size(&self, height: u32, width: u32) -> (u32, u32) {
        let resized = self.resized_size(height, width);
        self.center_crop.unwrap_or(resized)
    }

    fn resized_size(&self, height: u32, width: u32) -> (u32, u32) {
        match self.resize {
            None => (height, width),
            Some(ResizeTo::Exact { height, width }) => (height, width),
            Some(ResizeTo::ShortestEdge(short)) => {
                let (small, large) = if width <= height {
                    (width, height)
                } else {
                    (height, width)
                };
                let long = (short as u64 * large as u64 / small.max(1) as u64) as u32;
                if width <= height { (long, short) } else { (short, long) }
            }
        }
    }

    /// Decodes `bytes` (PNG, JPEG, WebP, GIF's first frame) and preprocesses the image.
    ///
    /// # Errors
    ///
    /// [`MediaError::Decode`] when the bytes do not decode, [`MediaError::TooLarge`] when the
    /// image has more pixels than `max_pixels`.
    pub fn preprocess(&self, bytes: &[u8]) -> Result<PixelValues, MediaError> {
        let rgb = decode_rgb(bytes, self.max_pixels)?;
        self.preprocess_rgb(&rgb)
    }

    /// Preprocesses an already decoded RGB image (a video frame).
    ///
    /// # Errors
    ///
    /// [`MediaError::Empty`] for a zero-sized image.
    pub fn preprocess_rgb(&self, rgb: &image::RgbImage) -> Result<PixelValues, MediaError> {
        let (width, height) = rgb.dimensions();
        if width == 0 || height == 0 {
            return Err(MediaError::Empty { kind: "image" });
        }
        let (new_height, new_width) = self.resized_size(height, width);
        let resized = if (new_height, new_width) == (height, width) {
            rgb.as_raw().clone()
        } else {
            crate::resample::resize_rgb8(
                rgb.as_raw(),
                width as usize,
                height as usize,
                new_width as usize,
                new_height as usize,
                self.resample,
            )
        };
        let (mut height, mut width) = (new_height as usize, new_width as usize);
        let mut pixels = resized;
        if let Some((crop_height, crop_width)) = self.center_crop {
            pixels = center_crop(&pixels, height, width, crop_height as usize, crop_width as usize);
            height = crop_height as usize;
            width = crop_width as usize;
        }
        let plane = height * width;
        let mut data = vec![0.0f32; 3 * plane];
        for (index, pixel) in pixels.as_chunks::<3>().0.iter().enumerate() {
            for channel in 0..3 {
                let mut value = pixel[channel] as f32;
                if let Some(scale) = self.rescale {
                    value = (pixel[channel] as f64 * scale) as f32;
                }
                if let Some((mean, std)) = &self.normalize {
                    value = (value - mean[channel]) / std[channel];
                }
                data[channel * plane + index] = value;
            }
        }
        Ok(PixelValues { height, width, data })
    }
}

/// Decodes an image's first frame to 8-bit RGB (transparency composited onto white and grey
/// replicated, as transformers' `convert_to_rgb`), refusing images over `max_pixels` before allocating them.
///
/// # Errors
///
/// [`MediaError::Decode`] or [`MediaError::TooLarge`].
pub fn decode_rgb(bytes: &[u8], max_pixels: u64) -> Result<image::RgbImage, MediaError> {
    let decode = |err: image::ImageError| MediaError::Decode {
        kind: "image",
        reason: err.to_string(),
    };
    let reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|err| MediaError::Decode {
            kind: "image",
            reason: err.to_string(),
        })?;
    let (width, height) = reader.into_dimensions().map_err(decode)?;
    if width as u64 * height as u64 > max_pixels {
        return Err(MediaError::TooLarge {
            kind: "image",
            reason: format!("{width}x{height} is more than {max_pixels} pixels"),
        });
    }
    let mut reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|err| MediaError::Decode {
            kind: "image",
            reason: err.to_string(),
        })?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    reader.limits(limits);
    let decoded = reader.decode().map_err(decode)?;
    if !decoded.color().has_alpha() {
        return Ok(decoded.to_rgb8());
    }
    // transformers' `convert_to_rgb` composites transparency onto white (Pillow's
    // `alpha_composite`, in its integer arithmetic), rather than dropping the alpha channel.
    let rgba = decoded.to_rgba8();
    let (width, height) = rgba.dimensions();
    let mut rgb = image::RgbImage::new(width, height);
    for (out, pixel) in rgb.pixels_mut().zip(rgba.pixels()) {
        out.0 = composite_on_white(pixel.0);
    }
    Ok(rgb)
}

/// Pillow's `ImagingAlphaComposite` of one pixel over opaque white (7 bits of extra precision,
/// rounded divisions by 255).
fn composite_on_white([r, g, b, a]: [u8; 4]) -> [u8; 3] {
    const PRECISION_BITS: u32 = 7;
    if a == 0 {
        return [255, 255, 255];
    }
    let div255 = |v: u32| ((v >> 8) + v) >> 8;
    let a = a as u32;
    let blend = 255 * (255 - a);
    let out_alpha255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / out_alpha255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let channel =
        |src: u8| (div255(src as u32 * coef1 + 255 * coef2 + (0x80 << PRECISION_BITS)) >> PRECISION_BITS) as u8;
    [channel(r), channel(g), channel(b)]
}

/// transformers' `center_crop` on an HWC RGB buffer: a side at least as long as the crop is cut
/// from `(size − crop) // 2`; a shorter side is zero-padded, `ceil((crop − size) / 2)` before it.
fn center_crop(pixels: &[u8], height: usize, width: usize, crop_height: usize, crop_width: usize) -> Vec<u8> {
    // Source index = output index + shift, per axis.
    let shift = |size: usize, crop: usize| -> isize {
        if size >= crop {
            ((size - crop) / 2) as isize
        } else {
            -((crop - size).div_ceil(2) as isize)
        }
    };
    let (row_shift, col_shift) = (shift(height, crop_height), shift(width, crop_width));
    let mut out = vec![0u8; crop_height * crop_width * 3];
    for row in 0..crop_height {
        let source_row = row as isize + row_shift;
        if source_row < 0 || source_row >= height as isize {
            continue;
        }
        for col in 0..crop_width {
            let source_col = col as isize + col_shift;
            if source_col < 0 || source_col >= width as isize {
                continue;
            }
            let from = (source_row as usize * width + source_col as usize) * 3;
            let to = (row * crop_width + col) * 3;
            out[to..to + 3].copy_from_slice(&pixels[from..from + 3]);
        }
    }
    out
}

fn pil_code(resample: Resample) -> usize {
    match resample {
        Resample::Nearest => 0,
        Resample::Lanczos => 1,
        Resample::Bilinear => 2,
        Resample::Bicubic => 3,
        Resample::Box => 4,
        Resample::Hamming => 5,
    }
}

fn positive(config: &ConfigObject<'_>, key: &str) -> Result<u32, LoadError> {
    let value = config.usize(key)?;
    u32::try_from(value)
        .ok()
        .filter(|&v| v > 0 && v <= 16384)
        .ok_or_else(|| config.error(key, format!("{value} is not a size from 1 to 16384")))
}

fn triple(config: &ConfigObject<'_>, key: &str, default: [f32; 3]) -> Result<[f32; 3], LoadError> {
    match config.get(key) {
        None => Ok(default),
        Some(serde_json::Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(0.0) as f32;
            Ok([v, v, v])
        }
        Some(serde_json::Value::Array(values)) if values.len() == 3 => {
            let mut out = [0.0f32; 3];
            for (slot, value) in out.iter_mut().zip(values) {
                *slot = value
                    .as_f64()
                    .ok_or_else(|| config.error(key, format!("expected numbers, found {value}")))?
                    as f32;
            }
            Ok(out)
        }
        Some(other) => Err(config.error(key, format!("expected three numbers, found {other}"))),
    }
}
