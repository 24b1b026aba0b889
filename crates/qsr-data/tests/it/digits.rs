//! The embedded sklearn digits: splits, shapes and labels as documented.

use qsr_data::*;

#[test]
fn digits_split_as_documented() {
    let train = digits(Split::Train);
    let test = digits(Split::Test);
    let all = digits_all();
    assert_eq!((train.len(), test.len(), all.len()), (1437, 360, 1797));
    assert_eq!((DIGITS_TRAIN, DIGITS_TEST, DIGITS_TOTAL), (1437, 360, 1797));
    for s in [&train, &test] {
        assert_eq!(s.classes(), 10);
        assert_eq!(s.shape(), Some((1, 8, 8)));
        assert_eq!(s.info().pixel_max, 16);
        assert!(!s.info().flip_ok);
        assert!(s.images.iter().all(|&v| v <= 16));
        assert!(s.labels.iter().all(|&l| l < 10));
        for c in 0..10u16 {
            assert!(s.labels.contains(&c), "class {c} missing");
        }
    }
    // train = first 1437 rows, test = last 360 rows of the file
    assert_eq!(&train.labels[..10], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(&test.labels[..10], &[2, 3, 4, 5, 6, 7, 8, 9, 0, 9]);
    assert_eq!(train.image(0), all.image(0));
    assert_eq!(test.image(0), all.image(1437));
    assert_eq!(&all.image(0)[..16], &[0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0], "first row of digits.csv");
    assert_eq!(*all.images.iter().max().unwrap(), 16);
}

#[test]
fn digits_defaults_do_not_flip() {
    let train = digits(Split::Train);
    let t = Transform::train_default(train.info());
    assert!(!t.flip);
    assert_eq!(t.crop, Crop::RandomPad { pad: 1 });
    assert_eq!(Transform::eval_default(train.info()).crop, Crop::None);
}
