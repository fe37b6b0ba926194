//! The daemon's TOML configuration: parsing, defaults and validation.
//!
//! Contract: [`Config::load`] either returns a configuration that the datapath can apply as a
//! whole, or an error naming the file, line, key and what to do. It never touches the kernel
//! beyond read-only lookups (interface names).

use std::{
    ffi::CString,
    fmt,
    ops::Range,
    path::{Path, PathBuf},
};

use serde::Deserialize;
use toml::Spanned;

/// Default bpffs directory for pinned maps and links.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/fastpath";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub datapath: DatapathSection,
    /// Interfaces the datapath attaches to (`[[interface]]` tables).
    #[serde(default, rename = "interface")]
    pub interfaces: Vec<InterfaceConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatapathSection {
    /// Where maps (`maps/`) and links (`links/`) are pinned. Default `/sys/fs/bpf/fastpath`.
    /// Must be on a bpffs; `/sys/fs/bpf` is mounted if it is not yet.
    #[serde(default = "default_pin_dir")]
    pub pin_dir: Spanned<PathBuf>,
    /// Drop malformed packets (counted with their reason) instead of handing them to the
    /// kernel. Default false: the kernel sees them and keeps its own counters.
    #[serde(default)]
    pub drop_malformed: bool,
    /// Detach programs and remove pins on a clean stop (SIGINT/SIGTERM). Default true; false
    /// leaves the datapath running without a daemon (as after a crash).
    #[serde(default = "default_true")]
    pub detach_on_exit: bool,
}

impl Default for DatapathSection {
    fn default() -> Self {
        DatapathSection {
            pin_dir: default_pin_dir(),
            drop_malformed: false,
            detach_on_exit: true,
        }
    }
}

fn default_pin_dir() -> Spanned<PathBuf> {
    Spanned::new(0..0, PathBuf::from(DEFAULT_PIN_DIR))
}

fn default_true() -> bool {
    true
}

/// XDP attachment mode.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native (driver) mode, falling back to generic (skb) mode with a warning. Default.
    #[default]
    Auto,
    /// Native only: fail if the driver has no XDP support.
    Native,
    /// Generic (skb) mode only.
    Generic,
    /// No XDP program on this interface.
    Off,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterfaceConfig {
    /// Interface name in the daemon's network namespace.
    pub name: Spanned<String>,
    /// XDP mode. Default `auto`.
    #[serde(default)]
    pub xdp: XdpMode,
    /// Attach the TC program at TCX ingress. Default false.
    #[serde(default)]
    pub tc_ingress: bool,
    /// Attach the TC program at TCX egress. Default false.
    #[serde(default)]
    pub tc_egress: bool,
}

/// Whether validation requires the named interfaces to exist in this network namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterfaceCheck {
    MustExist,
    Skip,
}

/// A configuration problem, located in the file.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub path: PathBuf,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// Dotted key, when known (e.g. `interface[1].name`).
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": key `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl Config {
    /// Reads, parses and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with(path, InterfaceCheck::MustExist)
    }

    /// As [`Config::load`], optionally without requiring the interfaces to exist here.
    pub fn load_with(path: &Path, interfaces: InterfaceCheck) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.to_owned(),
            line: None,
            key: None,
            message: format!("cannot read the config file: {e}; check the path given to --config"),
        })?;
        Config::parse_with(path, &text, interfaces)
    }

    /// Parses and validates `text` (read from `path`, used in messages).
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        Config::parse_with(path, text, InterfaceCheck::MustExist)
    }

    /// As [`Config::parse`], optionally without checking that interfaces exist here (for
    /// files meant for another machine, such as the examples in `config/`).
    pub fn parse_with(
        path: &Path,
        text: &str,
        interfaces: InterfaceCheck,
    ) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(text, s.start));
            ConfigError {
                path: path.to_owned(),
                line,
                key: None,
                message: format!(
                    "{}; see config/README.md for every key",
                    e.message().trim_end()
                ),
            }
        })?;
        config.validate(path, text, interfaces)?;
        Ok(config)
    }

    fn validate(
        &self,
        path: &Path,
        text: &str,
        interfaces: InterfaceCheck,
    ) -> Result<(), ConfigError> {
        let err = |span: Range<usize>, key: String, message: String| ConfigError {
            path: path.to_owned(),
            line: (span.end > 0).then(|| line_of(text, span.start)),
            key: Some(key),
            message,
        };
        let pin_dir = &self.datapath.pin_dir;
        if !pin_dir.get_ref().is_absolute() {
            return Err(err(
                pin_dir.span(),
                "datapath.pin_dir".into(),
                format!(
                    "{:?} is not an absolute path; use a directory on a bpffs such as {DEFAULT_PIN_DIR}",
                    pin_dir.get_ref()
                ),
            ));
        }
        if self.interfaces.is_empty() {
            return Err(ConfigError {
                path: path.to_owned(),
                line: None,
                key: Some("interface".into()),
                message: "no [[interface]] table: name at least one interface to attach to".into(),
            });
        }
        for (i, iface) in self.interfaces.iter().enumerate() {
            let name = iface.name.get_ref();
            let key = format!("interface[{i}].name");
            if let Some(j) = self.interfaces[..i]
                .iter()
                .position(|o| o.name.get_ref() == name)
            {
                return Err(err(
                    iface.name.span(),
                    key,
                    format!(
                        "interface {name:?} is listed twice (also interface[{j}]); merge the two tables"
                    ),
                ));
            }
            if interfaces == InterfaceCheck::MustExist && ifindex(name).is_none() {
                return Err(err(
                    iface.name.span(),
                    key,
                    format!(
                        "interface {name:?} not found in this network namespace; list interfaces with `ip link`"
                    ),
                ));
            }
            if iface.xdp == XdpMode::Off && !iface.tc_ingress && !iface.tc_egress {
                return Err(err(
                    iface.name.span(),
                    format!("interface[{i}]"),
                    format!(
                        "interface {name:?} has xdp = \"off\" and no TC hook: nothing to attach; enable a hook or remove the table"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Index of interface `name` in the current network namespace.
pub fn ifindex(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (idx != 0).then_some(idx)
}

/// 1-based line number of byte offset `at` in `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("test.toml"), text)
    }

    #[test]
    fn example_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("config/ exists") {
            let path = entry.expect("readable entry").path();
            if path.extension().is_some_and(|e| e == "toml") {
                let text = std::fs::read_to_string(&path).expect("readable example");
                if let Err(e) = Config::parse_with(&path, &text, InterfaceCheck::Skip) {
                    panic!("example {} is invalid: {e}", path.display());
                }
                seen += 1;
            }
        }
        assert!(
            seen >= 2,
            "expected the example configs in {}",
            dir.display()
        );
    }

    #[test]
    fn minimal_config_uses_defaults() {
        let c = parse("[[interface]]\nname = \"lo\"\n").expect("valid");
        assert_eq!(c.datapath.pin_dir.get_ref(), Path::new(DEFAULT_PIN_DIR));
        assert!(c.datapath.detach_on_exit);
        assert!(!c.datapath.drop_malformed);
        assert_eq!(c.interfaces[0].xdp, XdpMode::Auto);
        assert!(!c.interfaces[0].tc_ingress);
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let e = parse(
            "[datapath]\ndrop_malformed = true\n\n[[interface]]\nname = \"lo\"\nxdpp = \"auto\"\n",
        )
        .expect_err("typo must fail");
        assert_eq!(e.line, Some(6), "{e}");
        assert!(e.to_string().contains("xdpp"), "{e}");
    }

    #[test]
    fn missing_interface_names_key_and_line() {
        let e = parse("[[interface]]\nname = \"lo\"\n[[interface]]\nname = \"nosuch0\"\n")
            .expect_err("missing interface must fail");
        assert_eq!(e.line, Some(4), "{e}");
        assert_eq!(e.key.as_deref(), Some("interface[1].name"));
        assert!(e.to_string().contains("ip link"), "{e}");
    }

    #[test]
    fn bad_values_are_rejected() {
        let e = parse("[[interface]]\nname = \"lo\"\nxdp = \"turbo\"\n").expect_err("bad mode");
        assert_eq!(e.line, Some(3), "{e}");
        let e = parse("[datapath]\npin_dir = \"relative\"\n[[interface]]\nname = \"lo\"\n")
            .expect_err("relative pin dir");
        assert_eq!(e.line, Some(2), "{e}");
        let e =
            parse("[[interface]]\nname = \"lo\"\n[[interface]]\nname = \"lo\"\n").expect_err("dup");
        assert!(e.to_string().contains("twice"), "{e}");
        let e =
            parse("[[interface]]\nname = \"lo\"\nxdp = \"off\"\n").expect_err("nothing to attach");
        assert!(e.to_string().contains("nothing to attach"), "{e}");
        let e = parse("").expect_err("no interfaces");
        assert!(e.to_string().contains("[[interface]]"), "{e}");
    }
}
