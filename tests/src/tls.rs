//! Test certificates made with the `openssl` command: a private CA and
//! the certificates it signs (servers, clients with a SPIFFE URI SAN).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `openssl` in `dir`; panics with its error output if it fails.
pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl (scripts/setup.sh installs it): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A private CA in a directory: `ca.pem`, `ca.key`, and what it issues.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    /// Makes the CA (valid two days) in `dir`.
    pub fn new(dir: &Path) -> Pki {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=meshlimit test CA",
            ],
        );
        Pki {
            dir: dir.to_path_buf(),
        }
    }

    /// `<name>.pem` and `<name>.key`: a certificate signed by the CA, with
    /// extension `ext` (`subjectAltName=IP:127.0.0.1`,
    /// `subjectAltName=URI:spiffe://...`), which also makes it X.509 v3, the
    /// only version rustls takes.
    pub fn issue(&self, name: &str, ext: &str) {
        let d = &self.dir;
        let file = |suffix: &str| format!("{name}.{suffix}");
        std::fs::write(d.join(file("ext")), format!("{ext}\n"))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", file("ext")));
        openssl(
            d,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &file("key"),
                "-out",
                &file("csr"),
                "-subj",
                &format!("/CN={name}"),
            ],
        );
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                &file("csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &file("pem"),
                "-days",
                "2",
                "-extfile",
                &file("ext"),
            ],
        );
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }
}
