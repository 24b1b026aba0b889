//! The door against every kind of entry a path can hold.

use super::*;

/// What a test puts where qsr expects a file.
#[derive(Debug, Clone, Copy)]
enum Planted {
    Fifo,
    LinkToDevZero,
    LinkToFile,
    Directory,
    Sparse3Gb,
}

const ALL: [Planted; 5] =
    [Planted::Fifo, Planted::LinkToDevZero, Planted::LinkToFile, Planted::Directory, Planted::Sparse3Gb];

/// Plants `kind` at `dir/name`; a link's target file is `dir/target` holding `keep me`.
fn plant(dir: &Path, name: &str, kind: Planted) -> PathBuf {
    let path = dir.join(name);
    match kind {
        Planted::Fifo => {
            let status = std::process::Command::new("mkfifo").arg(&path).status().unwrap();
            assert!(status.success());
        }
        Planted::LinkToDevZero => std::os::unix::fs::symlink("/dev/zero", &path).unwrap(),
        Planted::LinkToFile => {
            std::fs::write(dir.join("target"), "keep me").unwrap();
            std::os::unix::fs::symlink(dir.join("target"), &path).unwrap();
        }
        Planted::Directory => std::fs::create_dir(&path).unwrap(),
        Planted::Sparse3Gb => File::create(&path).unwrap().set_len(3 << 30).unwrap(),
    }
    path
}

#[test]
fn reads_take_regular_files_within_their_bound_and_refuse_the_rest_naming_them() {
    for kind in ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = plant(dir.path(), "state.json", kind);
        let result = read(&path, 1 << 20, "checkpoint state");
        match kind {
            // A link to a regular file is read: users link their data and recipes.
            Planted::LinkToFile => assert_eq!(result.unwrap(), b"keep me"),
            _ => {
                let e = result.unwrap_err().to_string();
                assert!(e.contains("checkpoint state") && e.contains(&path.display().to_string()), "{kind:?}: {e}");
                let why = match kind {
                    Planted::Fifo => "(it is a FIFO)",
                    Planted::LinkToDevZero => "(it is a device)",
                    Planted::Directory => "(it is a directory)",
                    _ => "larger than 1048576 bytes",
                };
                assert!(e.contains(why), "{kind:?}: {e}");
            }
        }
    }
}

#[test]
fn an_atomic_write_replaces_whatever_is_there_except_a_directory_never_following_a_link() {
    for kind in ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = plant(dir.path(), "summary.json", kind);
        let result = write_atomic(&path, b"new", "summary");
        if let Planted::Directory = kind {
            let e = result.unwrap_err().to_string();
            assert!(e.contains("summary") && e.contains("(it is a directory)"), "{e}");
            assert!(path.is_dir());
        } else {
            result.unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), b"new", "{kind:?}");
            assert!(!path.symlink_metadata().unwrap().file_type().is_symlink(), "{kind:?}");
        }
        if let Planted::LinkToFile = kind {
            assert_eq!(std::fs::read(dir.path().join("target")).unwrap(), b"keep me");
        }
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")), "{kind:?}: {left:?}");
    }
}

#[test]
fn an_append_refuses_links_and_special_files_without_blocking() {
    for kind in ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = plant(dir.path(), "metrics.jsonl", kind);
        let result = append(&path, "metrics");
        match kind {
            // A large log is still a log.
            Planted::Sparse3Gb => drop(result.unwrap()),
            Planted::LinkToFile | Planted::LinkToDevZero => {
                let e = result.unwrap_err().to_string();
                assert!(e.contains("metrics") && e.contains("is a symbolic link"), "{kind:?}: {e}");
            }
            Planted::Fifo | Planted::Directory => {
                let e = result.unwrap_err().to_string();
                assert!(e.contains("metrics") && e.contains("is not a regular file"), "{kind:?}: {e}");
            }
        }
        if let Planted::LinkToFile = kind {
            assert_eq!(std::fs::read(dir.path().join("target")).unwrap(), b"keep me");
        }
    }
}

#[test]
fn an_uncommitted_new_file_leaves_the_target_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_atomic(&path, b"old", "model").unwrap();
    let mut file = NewFile::create(&path, "model").unwrap();
    file.write_all(b"half").unwrap();
    drop(file);
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn create_private_refuses_anything_already_there_a_dangling_link_included() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lock");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &path).unwrap();
    let e = create_private(&path, "shared-memory file").unwrap_err();
    assert!(matches!(&e, FileError::Io { source, .. } if source.kind() == io::ErrorKind::AlreadyExists), "{e}");
    assert!(!dir.path().join("nowhere").exists());
}

#[test]
fn a_file_error_becomes_an_io_error_with_its_message() {
    let e: io::Error = read(Path::new("/dev/zero"), 4, "recipe").unwrap_err().into();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("recipe /dev/zero is not a regular file"), "{e}");
}
